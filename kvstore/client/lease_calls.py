"""Where the shm path's lease RPCs go: the daemon's Unix socket when it offers one, else gRPC.

Each lease call answers ``(response message, trailing metadata dict)`` whichever way it went, and
raises the kvstore error the daemon raised. A socket that turns out to be gone (the daemon
restarted or pushed the connection out) is dropped and the call, and the ones after it until
the next negotiation, go over gRPC, whose retries and restart checks then apply: a daemon that
does not answer in time is ``DaemonUnavailable`` at once, not asked a second time.
"""

from __future__ import annotations

from kvstore.client.rpc import PendingCall, RpcChannel
from kvstore.client.rpc_errors import error_named
from kvstore.errors import DaemonUnavailable
from kvstore.transport.local_calls import RESPONSES, CallFailed, LocalCalls


class LeaseCalls:
    """``local``: the negotiated socket's ``LocalCalls`` (None: gRPC only), set by ``Negotiation``."""

    def __init__(self, rpc: RpcChannel) -> None:
        self.rpc = rpc
        self.local: LocalCalls | None = None

    def call(self, method: str, request) -> tuple[object, dict]:
        local = self.local
        if local is not None:
            try:
                data, meta = local.call(method, request.SerializeToString())
            except CallFailed as e:
                raise self.rpc.failed(error_named(e.kind, e.message, e.field)) from None
            except TimeoutError:
                raise self.rpc.failed(DaemonUnavailable(f"{method}: no answer from the daemon's socket "
                                                        f"within {self.rpc.timeout_s:g}s")) from None
            except OSError:
                self.drop(local)
            else:
                return RESPONSES[method].FromString(data), dict(meta)
        resp, answered = self.rpc.call(method, request, with_call=True)
        return resp, dict(answered.trailing_metadata() or ())

    def start(self, method: str, request, wait: bool = False) -> PendingCall:
        """``call`` on one of the channel's kept threads; ``result()`` is its response (or raises
        its error), ``trailing_metadata()`` its metadata. Over gRPC alone this is ``rpc.start``,
        whose failures the caller reads as ``grpc.RpcError``s. ``wait``: the caller has nothing
        to do meanwhile, so the call is made here and now (a hand-off to a thread and back costs
        more than a call over the socket saves on a small put)."""
        def answer():
            resp, meta = self.call(method, request)
            return resp, tuple(meta.items())
        if wait:
            return self.rpc.run_now(answer)
        if self.local is None:
            return self.rpc.start(method, request, self.rpc.timeout_s)
        return self.rpc.run_later(answer)

    def drop(self, local: LocalCalls) -> None:
        if self.local is local:
            self.local = None
        local.close()

    def close(self) -> None:
        local, self.local = self.local, None
        if local is not None:
            local.close()

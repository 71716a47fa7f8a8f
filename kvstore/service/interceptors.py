"""Authentication at the door: a KVStore call without a known bearer token is refused from its headers.

The interceptor runs on the event loop when a call's headers arrive, before any request message
is read and before a worker thread is involved, so an unauthenticated caller is answered
UNAUTHENTICATED at once: it never gets to stream bytes at the daemon and costs nothing while it
dawdles. Handlers still ask ``Authenticator.tenant`` which tenant is calling (defence in depth:
nothing reaches the Store unauthenticated even if the interceptor were left out). Health and
reflection stay open: probes carry no token. The refusal never repeats the offered token.

A fleet peer's ``KvsPeer`` proof (``kvstore.fleet.peer_proof``) is admitted here, once, whether auth
is on or not: a proof for another node, run, method or request, or one used before, is refused.
The call then answers with this node's own proof in its initial metadata, and its request message
must be the one the proof was made for.
"""

from __future__ import annotations

import hashlib
import hmac

import grpc

from kvstore.errors import Unauthenticated
from kvstore.service.auth import Authenticator
from kvstore.service.calls import status_of
from kvstore.service.metrics import Metrics
from kvstore.service.validation import Malformed


class _OtherRequest(Malformed):
    """The request message a peer proof was not made for."""

    def __init__(self) -> None:
        super().__init__("request")

    def error(self) -> Unauthenticated:
        return Unauthenticated("authorization: the peer proof was made for another request")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, service_name: str, method_names, metrics: Metrics) -> None:
        self.auth = auth
        # full method path -> name; an unknown method falls through to gRPC's UNIMPLEMENTED (and
        # never becomes a metrics label: callers must not be able to mint label values)
        self.methods = {f"/{service_name}/{name}": name for name in method_names}
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        name = self.methods.get(handler_call_details.method)
        if name is None:
            return await continuation(handler_call_details)
        metadata, peers = handler_call_details.invocation_metadata, self.auth.peers
        proof = self.auth.peer_proof(metadata)
        try:
            claim = peers.admit(proof, handler_call_details.method) if proof is not None else None
            if self.auth.enabled:
                self.auth.tenant(metadata)
        except Unauthenticated as err:
            return self._refusal(name, err)
        handler = await continuation(handler_call_details)
        if claim is None:
            return handler
        return _answered(handler, bytes.fromhex(claim.digest), peers.answer(claim, handler_call_details.method))

    def _refusal(self, name: str, err: Unauthenticated) -> grpc.RpcMethodHandler:
        code, details, meta = status_of(err)
        self.metrics.observe(name, 0.0, code.name)

        async def refuse(requests, context):
            # request-streaming, so gRPC does not wait for (or read) a request message first
            context.set_trailing_metadata(meta)
            await context.abort(code, details)

        return grpc.stream_unary_rpc_method_handler(refuse)


def _answered(handler: grpc.RpcMethodHandler, digest: bytes, answer: tuple[str, str]) -> grpc.RpcMethodHandler:
    """``handler`` that first sends ``answer`` (this node's proof) as initial metadata and takes
    only the request message whose SHA-256 is ``digest``. Every KVStore method is registered
    request-streaming (``calls.CallBridge``); a peer proof is admitted on unary-request ones only."""
    parse = handler.request_deserializer
    first = True

    def checked(raw: bytes):
        nonlocal first
        if first:
            first = False
            if not hmac.compare_digest(hashlib.sha256(raw).digest(), digest):
                return _OtherRequest()
        return parse(raw)

    field = "stream_stream" if handler.stream_stream is not None else "stream_unary"
    behaviour = getattr(handler, field)

    async def answered(requests, context):
        await context.send_initial_metadata((answer,))
        return await behaviour(requests, context)

    return handler._replace(request_deserializer=checked, **{field: answered})

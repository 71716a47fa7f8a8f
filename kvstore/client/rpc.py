"""The gRPC channel to one daemon: address parsing, credentials, and calls with retries.

Every call the Client makes goes through ``RpcChannel.call``, so the retry policy (idempotent
calls retried on UNAVAILABLE with short backoff inside the deadline) and the error mapping live in
one place. When the daemon turns out to be unreachable, ``on_unreachable`` runs (the Client drops
its negotiated transport then: a restarted daemon has a new arena and a new side channel).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client.rpc_errors import error_from_rpc
from kvstore.errors import DaemonUnavailable, InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.transport import chunks
from kvstore.wire import DEFAULT_URL

MAX_MESSAGE_BYTES = 64 << 20
CALLER_THREADS = 4   # unary calls in flight at once through ``RpcChannel.start`` (more wait their turn)


def parse_url(url: str | None) -> tuple[str, bool]:
    """``(host:port, tls)`` from ``host:port``, ``grpc[s]://`` or ``http[s]://`` (default: $KVSTORE_URL)."""
    url = url or os.environ.get("KVSTORE_URL") or DEFAULT_URL
    tls = False
    for prefix, secure in (("grpcs://", True), ("grpc://", False), ("http://", False), ("https://", True)):
        if url.startswith(prefix):
            url, tls = url[len(prefix):], secure
    if ":" not in url:
        raise InvalidArgument("url", f"{url!r} is not HOST:PORT")
    return url.rstrip("/"), tls


class RpcChannel:
    """One gRPC channel with the kvstore and health stubs and the caller's bearer token."""

    def __init__(self, url: str | None, token: str | None, timeout_s: float, retries: int,
                 root_ca: str | None, interceptors: tuple = ()) -> None:
        """``interceptors``: gRPC client interceptors every call goes through (a fleet peer's
        ``peer_proof.PeerProver``)."""
        self.address, tls = parse_url(url)
        self.host = self.address.rpartition(":")[0].strip("[]")
        self.timeout_s = timeout_s
        self.retries = retries
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.on_unreachable: Callable[[], None] = lambda: None
        self.closed = False
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.enable_retries", 0)]
        if tls or root_ca:
            ca = None  # None: the system's roots
            if root_ca:
                with open(root_ca, "rb") as f:
                    ca = f.read()
            self.channel = grpc.secure_channel(self.address, grpc.ssl_channel_credentials(ca), options)
        else:
            self.channel = grpc.insecure_channel(self.address, options)
        if interceptors:
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        # the data streams: Put's requests are encoded by the client (``chunks.put_messages``:
        # bytes), Get's answers read with their data left in place (``chunks.read_get_chunk``)
        self._encoded = {
            "Put": self.channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                                             response_deserializer=pb.PutResponse.FromString),
            "Get": self.channel.unary_stream("/kvstore.v1.KVStore/Get",
                                             request_serializer=pb.GetRequest.SerializeToString,
                                             response_deserializer=chunks.read_get_chunk)}
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._callers: KeptThreads | None = None   # ``start``'s threads, made on first use
        self._callers_pid = 0

    def call(self, method: str, request, timeout_s: float | None = None, stream_factory=None,
             with_call: bool = False):
        """One RPC with retries on UNAVAILABLE inside the deadline; raises kvstore errors.
        ``stream_factory`` builds a fresh request stream per attempt (streams are one-shot); a
        Put's is of encoded messages (``chunks.put_messages``), and a Get answers
        ``chunks.GetPiece``s."""
        if self.closed:
            raise DaemonUnavailable("client is closed")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        fn = self._encoded.get(method) or getattr(self.stub, method)
        if with_call:
            fn = fn.with_call
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                req = stream_factory() if stream_factory else request
                return fn(req, timeout=max(remaining, 0.001), metadata=self.metadata)
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if (isinstance(err, DaemonUnavailable) and e.code() == grpc.StatusCode.UNAVAILABLE
                        and attempt < self.retries and deadline - time.monotonic() > 0.05):
                    attempt += 1
                    time.sleep(min(0.05 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
                    continue
                raise self.failed(err) from None

    def future(self, method: str, request, timeout_s: float):
        """Start an RPC without waiting, as grpc's future (bulk transfers run the socket while it
        is in flight and may cancel it). Costs the caller a polling thread's start whenever no
        other call of the channel is in flight: a short unary call takes ``start``."""
        return getattr(self.stub, method).future(request, timeout=timeout_s, metadata=self.metadata)

    def start(self, method: str, request, timeout_s: float) -> PendingCall:
        """Start a short unary RPC without waiting: a blocking call on one of the channel's kept
        threads. grpc's ``future`` starts a thread to poll the channel whenever no other call is
        in flight (0.4-0.6 ms of the caller's time idle here, each time); handing the call to a
        thread that is already there costs tens of microseconds. No cancel: for lease RPCs,
        which the daemon answers at once."""
        if self.closed:
            raise DaemonUnavailable("client is closed")
        fn = getattr(self.stub, method).with_call

        def blocking_call():
            response, call = fn(request, timeout=timeout_s, metadata=self.metadata)
            return response, call.trailing_metadata()
        return self.run_later(blocking_call)

    def run_later(self, call: Callable[[], tuple]) -> PendingCall:
        """``call()`` (answering ``(response, trailing metadata)``) on one of the kept threads."""
        if self.closed:
            raise DaemonUnavailable("client is closed")
        if self._callers is None or self._callers_pid != os.getpid():   # first use, or a forked child
            self._callers = KeptThreads(CALLER_THREADS, "kvstore-rpc")
            self._callers_pid = os.getpid()
        try:
            return PendingCall(self._callers.submit(call))
        except RuntimeError:   # closed meanwhile: the pool takes no more calls
            raise DaemonUnavailable("client is closed") from None

    @staticmethod
    def run_now(call: Callable[[], tuple]) -> PendingCall:
        """``call()`` made here, answered as ``run_later``'s would be (its error raised by ``result()``)."""
        done: Future = Future()
        _settle(done, call)
        return PendingCall(done)

    def failed(self, err: Exception) -> Exception:
        """Note a failed call (an unreachable daemon resets the transport); returns ``err`` to raise."""
        if isinstance(err, DaemonUnavailable):
            self.on_unreachable()
        return err

    def health(self) -> bool:
        """True when the daemon answers SERVING; False when it is down, stopping or unreachable."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.closed = True
        if self._callers is not None:
            self._callers.shutdown()
        self.channel.close()


class KeptThreads:
    """A few daemon threads that run submitted calls, one started per call until there are
    ``size``. Not a ``ThreadPoolExecutor``, whose threads the interpreter joins when it exits: an
    engine exiting while a lease call waits on a hung daemon would wait out the client's timeout."""

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], tuple]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("shut down")
            self._work.put((fn, future))
            if len(self._threads) < self._size:
                thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                _settle(future, fn)

    def shutdown(self) -> None:
        """No more calls; each thread ends once the call it runs (if any) is over."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._work.put(None)


def _settle(future: Future, fn: Callable[[], tuple]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
        future.set_exception(e)


class PendingCall:
    """A call started by ``RpcChannel.start`` / ``run_later``: ``result()`` is its answer, or raises
    what it failed with (a ``grpc.RpcError`` for a gRPC call, as a grpc future's would);
    ``trailing_metadata()`` once answered."""

    def __init__(self, future: Future) -> None:
        self._future = future
        self._trailing = ()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        response, self._trailing = self._future.result(timeout)
        return response

    def trailing_metadata(self):
        return self._trailing or ()

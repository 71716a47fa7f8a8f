"""The daemon's gRPC endpoint: a ``grpc.aio`` server on its own event-loop thread.

Why aio: callers wait on the event loop, not on worker threads (``calls.py``), unauthenticated
calls are refused from their headers (``interceptors.py``), and health and reflection are served
on the loop itself, so a health check answers even while every worker is busy.

Bounds on what a connection can hold are ``SERVER_OPTIONS`` (a handshake's time, idle and
maximal age, keepalive, calls at once; clients reconnect transparently); the call-level ones are
the stall watch's (``calls.py``). Messages above ``max_message_bytes`` are refused by gRPC itself.
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
from collections.abc import Coroutine
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.auth import Authenticator
from kvstore.service.calls import CallBridge
from kvstore.service.config import Settings
from kvstore.service.interceptors import AuthInterceptor
from kvstore.service.lookup_indexes import LookupIndexes
from kvstore.service.metrics import Metrics
from kvstore.service.servicer import SERVICE_NAME, KVStoreServicer
from kvstore.service.validation import lenient
from kvstore.store import Store
from kvstore.threads import BUDGET
from kvstore.transport import chunks
from kvstore.transport.bulk_server import BulkServer
from kvstore.transport.local_calls import CallServer
from kvstore.transport.local_lookup import LocalLookupServer
from kvstore.transport.segments import SegmentBroker

METHOD_NAMES = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]

SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 5 * 60_000),
    ("grpc.max_connection_age_ms", 30 * 60_000),
    ("grpc.max_connection_age_grace_ms", 5 * 60_000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.max_concurrent_streams", 1024),
]


class GrpcServer:
    """A ``grpc.aio`` server whose event loop runs on a thread of its own, with the standard health
    service, whose answers (for the server and the KVStore service alike) any thread may set."""

    def __init__(self, workers: int) -> None:
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-rpc")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvstore-grpc-loop", daemon=True)
        self._thread.start()
        self.aio: grpc.aio.Server | None = None
        self.health: health_aio.HealthServicer | None = None

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(self.health.set(service, status), self.loop).result(10)

    def on_loop(self, coro: Coroutine):
        """Run ``coro`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self) -> None:
        self.on_loop(self.aio.start())

    def stop(self, grace_s: float | None = None) -> threading.Event:
        """Stop accepting calls, let those in flight finish for ``grace_s``, cancel the rest; the
        event is set once the server has stopped (the loop ends then; no new step starts)."""
        done = threading.Event()
        stopping = asyncio.run_coroutine_threadsafe(self.aio.stop(grace_s), self.loop)

        def finished(_) -> None:
            self.discard()
            done.set()

        stopping.add_done_callback(finished)
        return done

    def discard(self) -> None:
        """End the loop and the workers (after ``stop``, or for a server that never started)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)


def add_kvstore_servicer(servicer: KVStoreServicer, server: grpc.aio.Server, bridge: CallBridge) -> None:
    """Every KVStore method through the call bridge, with lenient request parsing so a malformed
    message is answered INVALID_ARGUMENT naming its type (see ``validation.lenient``)."""
    handlers = {}
    readers = {"Put": chunks.read_put_chunk}   # its payload stays where it arrived
    for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        parse = lenient(getattr(pb, m.input_type.name), readers.get(m.name))
        handlers[m.name] = bridge.method_handler(m, servicer.rpc(m.name), parse,
                                                 getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def build_server(store: Store, settings: Settings, auth: Authenticator, metrics: Metrics):
    """A ready-to-start gRPC server with the KVStore service, health and reflection, for
    ``settings``. Returns ``(server, servicer, port)``: a ``GrpcServer`` and the
    ``KVStoreServicer``; the caller starts and stops the server."""
    bulk = BulkServer(settings.host.strip("[]"), tokens=auth) if settings.bulk_channel and not settings.tls_cert \
        else None
    arena = store.shared_arena()
    segments = SegmentBroker(settings.shm_dir, arena.descriptor_for, arena.replaced_for, tokens=auth) \
        if arena is not None and arena.segmented else None
    threads = BUDGET.with_rpc(settings.workers)
    servicer = KVStoreServicer(store, settings, auth=auth, metrics=metrics, bulk=bulk, segments=segments,
                               threads=threads)
    # a same-host client's scheduler asks here instead of over gRPC
    servicer.local_lookups = LocalLookupServer(
        settings.shm_dir, servicer.local_lookup, servicer.local_lookup_told,
        LookupIndexes(store, per_tenant=auth.enabled, slots=settings.lookup_index_slots),
        CallServer(servicer.leases.local_call) if arena is not None else None, tokens=auth)
    credentials = None
    if settings.tls_cert:
        key, cert = (pathlib.Path(path).read_bytes() for path in (settings.tls_key, settings.tls_cert))
        credentials = grpc.ssl_server_credentials([(key, cert)])
    server = GrpcServer(threads.rpc)

    async def assemble():
        # created on the loop that will run it
        options = [("grpc.max_receive_message_length", settings.max_message_bytes),
                   ("grpc.max_send_message_length", settings.max_message_bytes), *SERVER_OPTIONS]
        aio = grpc.aio.server(migration_thread_pool=server.pool,
                              interceptors=[AuthInterceptor(auth, SERVICE_NAME, METHOD_NAMES, metrics)],
                              options=options)
        add_kvstore_servicer(servicer, aio, CallBridge(server.pool, servicer.stalls, metrics))
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, aio)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), aio)
        try:
            port = aio.add_secure_port(settings.listen, credentials) if credentials \
                else aio.add_insecure_port(settings.listen)
        except RuntimeError:   # grpc's "failed to bind"
            port = 0
        return aio, health, port

    try:
        server.aio, server.health, port = server.on_loop(assemble())
        if not port:
            raise OSError(f"listen: cannot bind {settings.listen}")
        server.set_serving(True)
    except Exception:
        server.discard()
        servicer.close_transports()
        raise
    return server, servicer, port

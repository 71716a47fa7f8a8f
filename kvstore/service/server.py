"""The gRPC servicer: validate every field, authorise, translate, call the Store.

Every handler runs inside ``_rpc``, which turns a ``KVStoreError`` into its gRPC status (the
class's ``grpc_status``) with trailing metadata naming the class and the field, turns anything
unexpected into INTERNAL, and records latency — so no request can crash the daemon, and a client
sees the same exception class the store raised. Messages larger than ``max_message_bytes`` are
refused by gRPC itself with RESOURCE_EXHAUSTED.

Tenancy (see ``kvstore.service.auth``): the caller's tenant is folded into every namespace it registers;
a namespace id of another tenant is answered like an unknown one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import secrets
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.service.auth import Authenticator
from kvstore.errors import (CodecError, FleetModeOff, InvalidArgument, KVStoreError, LayoutMismatch, LeaseExpired,
                            PermissionDenied, UnknownNamespace)
from kvstore.keys import MAX_HASH_BYTES, KVLayout, Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.store import Store
from kvstore.wire import (MAX_BATCH, MAX_LOOKUP_BATCH, MAX_STRING, PROTOCOL_VERSION, RAW_CODEC, SERVER_ID_KEY,
                          UNSTAGED_KEY)
from kvstore.transport import bulk as bulk_transport
from kvstore.transport import chunks, shm

log = logging.getLogger("kvstore.service.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
_PIN_WINDOW_BYTES = 256 << 20   # bulk reads pin at most this much of the arena at a time
_PUT_RESULT = {"stored": pb.PUT_STORED, "exists": pb.PUT_EXISTS, "persisted": pb.PUT_PERSISTED}


def _status_code(err: KVStoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_status, grpc.StatusCode.INTERNAL)


def _abort(context, method: str, err: Exception, metrics) -> None:
    if isinstance(err, KVStoreError):
        code, message = _status_code(err), str(err)
        meta = [("kvstore-error", type(err).__name__)]
        if getattr(err, "field", None):
            meta.append(("kvstore-field", str(err.field)))
    else:
        log.exception("unexpected error in %s", method)
        code, message, meta = grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}", []
    if metrics is not None:
        metrics.errors.labels(method, code.name).inc()
    context.set_trailing_metadata(meta)
    context.abort(code, message[:2000])


class _Malformed:
    """What arrives in place of a request whose bytes are not a valid protobuf message."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _lenient(message_cls):
    """Request deserializer that never raises (gRPC would answer its own INTERNAL): the handler
    answers INVALID_ARGUMENT naming the message type instead."""
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            return _Malformed(message_cls.DESCRIPTOR.full_name)
    return parse


def _malformed(m: _Malformed) -> InvalidArgument:
    return InvalidArgument("request", f"not a valid {m.type_name} message (malformed protobuf)")


def _checked_stream(requests):
    for m in requests:
        if isinstance(m, _Malformed):
            raise _malformed(m)
        yield m


def _checked(request):
    if isinstance(request, _Malformed):
        raise _malformed(request)
    if hasattr(request, "__next__"):  # a client stream: check each message as it is read
        return _checked_stream(request)
    return request


def _rpc(method):
    """Unary handler wrapper: status mapping + latency."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        t0 = time.perf_counter()
        try:
            return method(self, _checked(request), context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a crash
            if isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortionError":
                raise
            _abort(context, method.__name__, e, self.metrics)
        finally:
            if self.metrics is not None:
                self.metrics.latency.labels(method.__name__).observe(time.perf_counter() - t0)
    return wrapper


def _rpc_stream(method):
    """Server-streaming handler wrapper (the handler is a generator)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        t0 = time.perf_counter()
        try:
            yield from method(self, _checked(request), context)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortionError":
                raise
            _abort(context, method.__name__, e, self.metrics)
        finally:
            if self.metrics is not None:
                self.metrics.latency.labels(method.__name__).observe(time.perf_counter() - t0)
    return wrapper


def check_hashes(hashes, field: str = "hashes", allow_empty: bool = False) -> list[bytes]:
    if len(hashes) > MAX_BATCH:
        raise InvalidArgument(field, f"{len(hashes)} hashes in one call; at most {MAX_BATCH}")
    if not hashes and not allow_empty:
        raise InvalidArgument(field, "at least one block hash is required")
    out = []
    for i, h in enumerate(hashes):
        if not 1 <= len(h) <= MAX_HASH_BYTES:
            raise InvalidArgument(f"{field}[{i}]", f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(h)}")
        out.append(bytes(h))
    return out


def check_parent(parent: bytes) -> bytes | None:
    if not parent:
        return None
    if len(parent) > MAX_HASH_BYTES:
        raise InvalidArgument("parent", f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(parent)}")
    return bytes(parent)


def layout_from_proto(m: pb.Layout) -> KVLayout:
    """Proto3 zeros mean "unset": fall back to KVLayout's defaults so old clients keep working."""
    for name in ("model", "dtype", "layout"):
        if len(getattr(m, name)) > MAX_STRING:
            raise InvalidArgument(f"layout.{name}", f"longer than {MAX_STRING} characters")
    return KVLayout(model=m.model, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim, dtype=m.dtype, block_tokens=m.block_tokens,
                    layout=m.layout or "opaque", kv_per_token=m.kv_per_token or 2,
                    tp_rank=m.tp_rank, tp_size=m.tp_size or 1, pp_rank=m.pp_rank, pp_size=m.pp_size or 1,
                    cp_rank=m.cp_rank, cp_size=m.cp_size or 1, block_bytes=m.block_bytes)


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    return pb.Layout(**layout.to_dict())


class _Pool(threading.local):
    """One pre-touched payload buffer per server thread (no fresh large allocation per request)."""

    def get(self, nbytes: int) -> np.ndarray:
        buf = getattr(self, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.zeros(max(nbytes, 1 << 20), dtype=np.uint8)
            self.buf = buf
        return buf[:nbytes]


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: Store, *, auth: Authenticator | None = None, metrics=None,
                 shm_dir: str = "/dev/shm", offer_shm: bool = True, chunk_bytes: int = chunks.DEFAULT_CHUNK_BYTES,
                 max_message_bytes: int = 16 << 20, bulk: bulk_transport.BulkServer | None = None,
                 stream_idle_s: float = 30.0) -> None:
        self.store = store
        self.auth = auth or Authenticator()
        self.metrics = metrics
        self.shm_dir = shm_dir
        self.offer_shm = offer_shm
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.bulk = bulk
        self.server_id = secrets.token_hex(8)
        self.fleet = None  # kvstore.fleet.Fleet in fleet mode (set by the daemon)
        self.started = time.time()
        self._pool = _Pool()
        self._lease_owner: dict[int, tuple[str, float, int]] = {}  # public id -> tenant, until, store id
        self._lease_lock = threading.Lock()
        self.stream_idle_s = stream_idle_s
        self.stalled_streams_cancelled = 0
        self._watched_streams: dict[object, tuple] = {}
        self._watch_lock = threading.Lock()
        self._quota_pending: dict[str, int] = {}
        self._quota_lock = threading.Lock()

    # -- helpers ---------------------------------------------------------------------------------

    def _tenant(self, context, requested: str = "") -> str:
        return self.auth.tenant(context.invocation_metadata(), requested)

    def _namespace(self, context, namespace_id: bytes, block_bytes: int = 0) -> Namespace:
        """The caller's namespace, or NOT_FOUND (also for another tenant's: no probing)."""
        tenant = self._tenant(context)
        if len(namespace_id) != 16:
            raise InvalidArgument("namespace_id", f"must be 16 bytes (from RegisterNamespace), got {len(namespace_id)}")
        try:
            ns = self.store.namespace(bytes(namespace_id))
        except UnknownNamespace:
            raise UnknownNamespace(bytes(namespace_id)) from None
        if self.auth.enabled and ns.tenant != tenant:
            raise UnknownNamespace(bytes(namespace_id))
        if block_bytes and block_bytes != ns.block_bytes:
            raise LayoutMismatch(f"block_bytes: the client expects {block_bytes}-byte blocks; namespace "
                                 f"{ns.id.hex()} has {ns.block_bytes}-byte blocks (layout differs)")
        return ns

    def _tenant_bytes(self, tenant: str) -> int:
        return sum(self.store.namespace_bytes(ns.id) for ns in self.store.namespaces() if ns.tenant == tenant)

    def _own_lease(self, store_lease_id: int, tenant: str) -> int:
        """The id the client sees: random, so a stale or hostile client cannot name another
        client's lease (store ids count up from 1 in every daemon run)."""
        with self._lease_lock:
            public = secrets.randbits(63) or 1
            while public in self._lease_owner:
                public = secrets.randbits(63) or 1
            self._lease_owner[public] = (tenant, time.monotonic() + self.store.config.lease_seconds + 1,
                                         store_lease_id)
        return public

    def _check_lease(self, context, lease_id: int) -> int:
        """The store's lease id behind the caller's ``lease_id``; only its owner may use it."""
        tenant = self._tenant(context)
        with self._lease_lock:
            owner = self._lease_owner.get(lease_id)
            if owner is not None and owner[0] == tenant:
                del self._lease_owner[lease_id]
                return owner[2]
        raise LeaseExpired(f"lease_id: lease {lease_id} is unknown or expired")

    def prune_leases(self) -> None:
        now = time.monotonic()
        with self._lease_lock:
            for lid in [k for k, (_, until, _) in self._lease_owner.items() if until < now]:
                del self._lease_owner[lid]

    def _identify(self, context, unstaged: bool = False) -> None:
        """Tell a same-host client which daemon run answered: its arena mapping is only valid
        for that run (a restarted daemon has a new arena; stale offsets would be wrong bytes).
        ``unstaged``: a load stopped at a block that *is* present but could not be staged in the
        arena right now (every slot pinned), so the client fetches it another way, not a miss."""
        meta = [(SERVER_ID_KEY, self.server_id)]
        if unstaged:
            meta.append((UNSTAGED_KEY, "1"))
        context.set_trailing_metadata(tuple(meta))

    # -- stalled streams ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _watched(self, context, on_stall=None):
        """Register a streaming RPC so ``cancel_stalled_streams`` can end it if its peer stops
        sending or reading: each stalled stream holds one of the server's worker threads, so a
        handful of slowloris clients would otherwise starve everyone. Yields ``touch()``."""
        token = object()
        cell = [time.monotonic()]

        def touch() -> None:
            cell[0] = time.monotonic()

        with self._watch_lock:
            self._watched_streams[token] = (cell, context, on_stall)
        try:
            yield touch
        finally:
            with self._watch_lock:
                self._watched_streams.pop(token, None)

    def cancel_stalled_streams(self, idle_s: float | None = None) -> int:
        """Cancel streams idle for longer than ``idle_s`` (default ``stream_idle_s``)."""
        idle_s = self.stream_idle_s if idle_s is None else idle_s
        cutoff = time.monotonic() - idle_s
        with self._watch_lock:
            stalled = [(ctx, on_stall) for cell, ctx, on_stall in self._watched_streams.values()
                       if cell[0] < cutoff]
            for cell, _, _ in self._watched_streams.values():
                cell[0] = max(cell[0], cutoff + idle_s) if cell[0] < cutoff else cell[0]  # once per idle period
        for ctx, on_stall in stalled:
            log.warning("cancelling a stream idle for more than %.1fs (stalled client)", idle_s)
            if on_stall is not None:
                on_stall()
            ctx.cancel()
        if stalled:
            self.stalled_streams_cancelled += len(stalled)
        return len(stalled)

    # -- quotas ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _quota(self, ns: Namespace, hashes: list[bytes]):
        """Check and reserve the bytes a put may add, so concurrent writers of one tenant cannot
        all pass the check before any of them has stored (check-then-act race)."""
        if ns.tenant not in self.auth.quotas:
            yield
            return
        new = sum(1 for present in self.store.contains(ns.id, hashes) if not present) * ns.block_bytes
        with self._quota_lock:
            pending = self._quota_pending.get(ns.tenant, 0)
            self.auth.check_quota(ns.tenant, self._tenant_bytes(ns.tenant) + pending, new)
            self._quota_pending[ns.tenant] = pending + new
        try:
            yield
        finally:
            with self._quota_lock:
                self._quota_pending[ns.tenant] -= new

    def _moved(self, direction: str, transport: str, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.moved(direction, transport, nbytes)

    # -- control ---------------------------------------------------------------------------------

    @_rpc
    def Handshake(self, request, context):
        tenant = self._tenant(context)
        if request.nonce and not 16 <= len(request.nonce) <= 64:
            raise InvalidArgument("nonce", f"must be 16..64 bytes, got {len(request.nonce)}")
        resp = pb.HandshakeResponse(server_version=PROTOCOL_VERSION, server_id=self.server_id,
                                    lease_seconds=self.store.config.lease_seconds,
                                    max_message_bytes=self.max_message_bytes, chunk_bytes=self.chunk_bytes,
                                    tenant=tenant)
        arena = self.store.shared_arena()
        if arena is not None and self.offer_shm and request.nonce:
            resp.arena_dev, resp.arena_ino = arena.st_dev, arena.st_ino
            resp.arena_path = arena.path
            resp.arena_bytes = arena.nbytes
            resp.probe_path = shm.write_probe(self.shm_dir, bytes(request.nonce))
        if self.bulk is not None:
            resp.bulk_port = self.bulk.port
            resp.bulk_ticket = self.bulk.ticket
        return resp

    @_rpc
    def RegisterNamespace(self, request, context):
        if len(request.cache_salt) > MAX_STRING:
            raise InvalidArgument("cache_salt", f"longer than {MAX_STRING} characters")
        if len(request.tenant) > MAX_STRING:
            raise InvalidArgument("tenant", f"longer than {MAX_STRING} characters")
        tenant = self._tenant(context, request.tenant)
        if not request.HasField("layout"):
            raise InvalidArgument("layout", "the KV layout descriptor is required")
        ns = Namespace(layout_from_proto(request.layout), tenant=tenant, cache_salt=request.cache_salt)
        ns_id = self.store.register_namespace(ns)
        return pb.RegisterNamespaceResponse(namespace_id=ns_id, block_bytes=ns.block_bytes, tenant=tenant)

    def _lookup(self, context, request) -> pb.LookupResponse:
        ns = self._namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        if not hashes:
            return pb.LookupResponse(num_hit=0)
        # in fleet mode a short local run is completed from peers (only Lookup fetches: no loops)
        found = (self.fleet or self.store).lookup(ns.id, hashes, lease=not request.no_lease)
        return pb.LookupResponse(num_hit=found.num_hit, tiers=found.tiers)

    @_rpc
    def Route(self, request, context):
        ns = self._namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        if self.fleet is None:
            raise FleetModeOff("fleet: fleet mode is off on this daemon (set fleet.enabled)")
        out = pb.RouteResponse()
        for r in self.fleet.route(ns.id, hashes):
            out.nodes.add(node_id=r.node_id, address=r.address, blocks=r.blocks, tokens=r.tokens or 0,
                          memory_blocks=r.tiers.get("memory", 0), disk_blocks=r.tiers.get("disk", 0))
        return out

    @_rpc
    def Lookup(self, request, context):
        return self._lookup(context, request)

    @_rpc
    def LookupBatch(self, request, context):
        if len(request.requests) > MAX_LOOKUP_BATCH:
            raise InvalidArgument("requests", f"{len(request.requests)} lookups in one call; at most {MAX_LOOKUP_BATCH}")
        out = pb.LookupBatchResponse()
        for i, r in enumerate(request.requests):
            try:
                out.responses.append(self._lookup(context, r))
            except InvalidArgument as e:
                raise InvalidArgument(f"requests[{i}].{e.field}", str(e).split(": ", 1)[-1]) from None
        return out

    @_rpc
    def Exists(self, request, context):
        ns = self._namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        return pb.ExistsResponse(present=self.store.contains(ns.id, hashes) if hashes else [])

    @_rpc
    def Delete(self, request, context):
        ns = self._namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        return pb.DeleteResponse(deleted=self.store.delete(ns.id, hashes) if hashes else 0)

    @_rpc
    def Stats(self, request, context):
        tenant = self._tenant(context)
        stats = self.store.stats()
        stats["server"] = {"server_id": self.server_id, "uptime_s": round(time.time() - self.started, 3),
                           "bulk_sessions": self.bulk.session_count if self.bulk else 0,
                           "tenant": tenant, "tenant_bytes": self._tenant_bytes(tenant),
                           "client_leases": len(self._lease_owner), "open_streams": len(self._watched_streams),
                           "stalled_streams_cancelled": self.stalled_streams_cancelled}
        if self.fleet is not None:
            stats["fleet"] = self.fleet.stats()
        return pb.StatsResponse(json=json.dumps(stats, sort_keys=True))

    # -- gRPC streams ----------------------------------------------------------------------------

    @_rpc
    def Put(self, request_iterator, context):
        with self._watched(context) as touch:
            return self._put_stream(request_iterator, context, touch)

    def _put_stream(self, request_iterator, context, touch):
        first = next(request_iterator, None)
        touch()
        if first is None or not first.HasField("header"):
            raise InvalidArgument("header", "the first message of a Put stream must carry the header")
        h = first.header
        ns = self._namespace(context, h.namespace_id, h.block_bytes)
        hashes = check_hashes(h.hashes)
        parent = check_parent(h.parent)
        if h.codec != RAW_CODEC:
            raise CodecError(f"codec: payloads must be raw (0) on the wire, got codec {h.codec}")
        expected = len(hashes) * ns.block_bytes
        splitter = chunks.BlockSplitter(ns.block_bytes, self._pool.get(ns.block_bytes))
        results: list[int] = []
        received = 0
        msg = first
        with self._quota(ns, hashes):
            while msg is not None:
                if msg is not first and msg.HasField("header"):
                    raise InvalidArgument("header", "only the first message of a Put stream may carry a header")
                received += len(msg.data)
                if received > expected:
                    raise InvalidArgument("data", f"the stream carries more than {expected} bytes "
                                                  f"({len(hashes)} blocks of {ns.block_bytes})")
                for i, block in splitter.feed(msg.data):
                    p = parent if i == 0 else hashes[i - 1]
                    results.append(_PUT_RESULT[self.store.put(ns.id, [hashes[i]], [block], parent=p)[0]])
                msg = next(request_iterator, None)
                touch()
        if not context.is_active():
            raise InvalidArgument("data", "the stream was cancelled (stalled client)")
        if received < expected:
            raise InvalidArgument("data", f"the stream ended after {received} of {expected} bytes; "
                                          f"{len(results)} of {len(hashes)} blocks were stored")
        self._moved("in", "grpc", received)
        return pb.PutResponse(results=results)

    @_rpc_stream
    def Get(self, request, context):
        ns = self._namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        chunk = request.chunk_bytes or self.chunk_bytes
        chunk = max(4096, min(chunk, self.max_message_bytes - 4096))
        sent = 0
        # Chunks are copied out of the pinned arena as gRPC asks for them; a block whose pin ran
        # out meanwhile ends the stream with an error (the client then trusts none of it).
        with self._watched(context) as touch, contextlib.closing(self._pinned_blocks(ns, hashes)) as blocks:
            for i, block in enumerate(blocks):
                sent += 0 if block is None else block.nbytes
                for message in chunks.get_messages(i, block, RAW_CODEC, chunk):
                    yield message
                    touch()
                if not context.is_active():
                    return
        self._moved("out", "grpc", sent)

    # -- same-host zero-copy ---------------------------------------------------------------------

    def _lease_response(self, lease, public_id: int, present_none: bool, size: int) -> pb.LeaseResponse:
        resp = pb.LeaseResponse(lease_id=public_id, expires_in=self.store.config.lease_seconds)
        for ext in lease.extents:
            b = resp.blocks.add(present=ext is None and present_none, codec=RAW_CODEC, size=size)
            for off, length in ext or ():
                b.extents.add(offset=off, length=length)
        return resp

    def _require_shared_arena(self) -> None:
        """The zero-copy RPCs only where the arena is offered: with auth on (and shm_with_auth
        off) a tenant completing a store it never wrote would publish the previous occupant's
        bytes of those slots (another tenant's data) as its own block."""
        if not self.offer_shm:
            raise PermissionDenied("transport: this daemon does not share its CPU arena with clients "
                                   "(auth is on); use the gRPC or side-channel transports")

    @_rpc
    def PrepareStore(self, request, context):
        self._require_shared_arena()
        ns = self._namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        parent = check_parent(request.parent)
        with self._quota(ns, hashes):
            lease = self.store.prepare_store(ns.id, hashes, parent)
        self._identify(context)
        return self._lease_response(lease, self._own_lease(lease.id, ns.tenant), True, ns.block_bytes)

    @_rpc
    def CompleteStore(self, request, context):
        results = self.store.complete_store(self._check_lease(context, request.lease_id))
        return pb.PutResponse(results=[_PUT_RESULT[r] for r in results])

    @_rpc
    def AbortStore(self, request, context):
        self.store.abort_store(self._check_lease(context, request.lease_id))
        return pb.Empty()

    @_rpc
    def PrepareLoad(self, request, context):
        self._require_shared_arena()
        ns = self._namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        lease = self.store.prepare_load(ns.id, hashes)
        stop = len(lease.extents)
        self._identify(context, unstaged=stop < len(hashes) and self.store.contains(ns.id, [hashes[stop]])[0])
        return self._lease_response(lease, self._own_lease(lease.id, ns.tenant), False, ns.block_bytes)

    @_rpc
    def CompleteLoad(self, request, context):
        self.store.complete_load(self._check_lease(context, request.lease_id))
        return pb.Empty()

    # -- bulk side channel -----------------------------------------------------------------------

    def _session(self, sid: bytes):
        session = self.bulk.session(bytes(sid)) if self.bulk is not None else None
        if session is None:
            raise InvalidArgument("session", "unknown side-channel session; reconnect or use the gRPC stream")
        return session

    def _pinned_blocks(self, ns: Namespace, hashes: list[bytes]):
        """Each block as one zero-copy view of the CPU arena while it is pinned (None = miss), so
        the side channel sends straight from the arena. Blocks are pinned a window at a time
        (at most ``_PIN_WINDOW_BYTES`` or an eighth of the arena) under a store lease; if sending
        a block outlived the lease, its slots may have been reused meanwhile, so that raises
        LeaseExpired and the caller signals an error instead of vouching for those bytes."""
        arena = self.store.shared_arena()
        window = 1 if arena is None else max(1, min(_PIN_WINDOW_BYTES, arena.capacity_bytes // 8) // ns.block_bytes)
        start = 0
        while start < len(hashes):
            if arena is None:  # no arena: copy through a pooled buffer
                buf = self._pool.get(ns.block_bytes)
                n = self.store.get_into(ns.id, [hashes[start]], [buf])[0]
                yield None if n is None else buf[:n]
                start += 1
                continue
            asked = len(hashes[start:start + window])
            lease = self.store.prepare_load(ns.id, hashes[start:start + window])
            try:
                for extents in lease.extents:
                    views = arena.views(extents)
                    yield views[0] if len(views) == 1 else np.concatenate(views)
                    if time.monotonic() >= lease.expires:
                        raise LeaseExpired("lease_id: sending a block outlived its pin (lease_seconds too short "
                                           "for this link); retry")
            finally:
                try:
                    self.store.complete_load(lease.id)
                except LeaseExpired:
                    pass
            start += len(lease.extents)
            if len(lease.extents) < asked:
                # The block that stopped the lease: absent, or present but not stageable in the arena
                # right now (every slot pinned). Read the latter through a buffer: a false miss would
                # make an engine recompute a block that is sitting on NVMe.
                h, block = hashes[start], None
                if self.store.contains(ns.id, [h])[0]:
                    buf = self._pool.get(ns.block_bytes)
                    n = self.store.get_into(ns.id, [h], [buf])[0]
                    block = None if n is None else buf[:n]
                yield block
                start += 1

    @_rpc
    def BulkGet(self, request, context):
        session = self._session(request.session)
        sid = bytes(request.session)
        with self._watched(context, on_stall=lambda: self.bulk.drop(sid)) as touch, session.lock:
            sent = 0
            try:
                ns = self._namespace(context, request.namespace_id, request.block_bytes)
                hashes = check_hashes(request.hashes)
                sizes = []
                with contextlib.closing(self._pinned_blocks(ns, hashes)) as blocks:  # unpin on any exit
                    for block in blocks:
                        bulk_transport.send_block(session.sock, block)
                        touch()
                        sizes.append(0 if block is None else block.nbytes)
                        sent += sizes[-1]
            except OSError as e:
                self.bulk.drop(bytes(request.session))
                raise InvalidArgument("session", f"side channel failed: {e}") from e
            except Exception:
                try:
                    bulk_transport.send_error(session.sock)
                except OSError:
                    self.bulk.drop(bytes(request.session))
                raise
        self._moved("out", "bulk", sent)
        return pb.BulkGetResponse(sizes=sizes, codecs=[RAW_CODEC] * len(sizes))

    @_rpc
    def BulkPut(self, request, context):
        session = self._session(request.session)
        # What the client committed to send: its own idea of the block size times the count.
        if len(request.hashes) > MAX_BATCH or request.block_bytes > self.store.largest_block_bytes + (1 << 30):
            self.bulk.drop(bytes(request.session))  # cannot drain an absurd amount: cut the channel
            raise InvalidArgument("block_bytes" if len(request.hashes) <= MAX_BATCH else "hashes",
                                  "request too large for the side channel")
        committed = len(request.hashes) * request.block_bytes
        sid = bytes(request.session)
        with self._watched(context, on_stall=lambda: self.bulk.drop(sid)) as touch, session.lock:
            received = 0
            results: list[int] = []
            try:
                if not request.block_bytes:
                    raise InvalidArgument("block_bytes", "required on the side channel")
                ns = self._namespace(context, request.namespace_id, request.block_bytes)
                hashes = check_hashes(request.hashes)
                parent = check_parent(request.parent)
                buf = self._pool.get(ns.block_bytes)
                with self._quota(ns, hashes):
                    for i, h in enumerate(hashes):
                        bulk_transport.recv_exact_into(session.sock, memoryview(buf))
                        touch()
                        received += ns.block_bytes
                        p = parent if i == 0 else hashes[i - 1]
                        results.append(_PUT_RESULT[self.store.put(ns.id, [h], [buf], parent=p)[0]])
            except OSError as e:
                self.bulk.drop(bytes(request.session))
                raise InvalidArgument("session", f"side channel failed: {e}") from e
            except Exception:
                try:
                    bulk_transport.drain(session.sock, committed - received, self._pool.get(1 << 20))
                except OSError:
                    self.bulk.drop(bytes(request.session))
                raise
        self._moved("in", "bulk", received)
        return pb.PutResponse(results=results)


def add_kvstore_servicer(servicer: KVStoreServicer, server) -> None:
    """Like the generated ``add_KVStoreServicer_to_server``, but with lenient request parsing so
    a malformed message is answered INVALID_ARGUMENT by our handler (see ``_lenient``)."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        make = kinds[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=_lenient(getattr(pb, m.input_type.name)),
                                response_serializer=getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def build_server(store: Store, *, listen: str, workers: int = 16, max_message_bytes: int = 16 << 20,
                 chunk_bytes: int = 1 << 20, auth: Authenticator | None = None, metrics=None,
                 shm_dir: str = "/dev/shm", offer_shm: bool = True, bulk_channel: bool = True,
                 tls_cert: str | None = None, tls_key: str | None = None, stream_idle_s: float = 30.0):
    """A ready-to-start gRPC server with the KVStore service, health and reflection.

    Returns ``(server, servicer, health_servicer, port)``; the caller starts and stops it."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-rpc"),
                         options=options)
    host = listen.rpartition(":")[0].strip("[]")
    bulk = bulk_transport.BulkServer(host) if bulk_channel and not tls_cert else None
    servicer = KVStoreServicer(store, auth=auth, metrics=metrics, shm_dir=shm_dir, offer_shm=offer_shm,
                               chunk_bytes=chunk_bytes, max_message_bytes=max_message_bytes, bulk=bulk,
                               stream_idle_s=stream_idle_s)
    add_kvstore_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    if tls_cert:
        with open(tls_key, "rb") as f:
            key = f.read()
        with open(tls_cert, "rb") as f:
            cert = f.read()
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(listen)
    if not port:
        raise OSError(f"listen: cannot bind {listen}")
    return server, servicer, health_servicer, port

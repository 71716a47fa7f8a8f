"""The one client every connector and CLI command uses (sync ``Client`` and asyncio ``AsyncClient``).

    c = Client("127.0.0.1:7373", token=None, timeout_s=5.0, transport="auto")
    ns_id = c.register_namespace(Namespace(layout, cache_salt="..."))
    c.put(ns_id, hashes, blocks)            # bytes / numpy / CPU torch tensors
    sizes = c.get_into(ns_id, hashes, outs)  # None = miss

Transports (``transport=``):

* ``"auto"`` — shm when the daemon's arena is openable on this host (proved by a nonce the daemon
  writes next to the arena and by the arena file's identity), else the raw-TCP bulk side channel,
  else gRPC streams.
* ``"shm"`` — same host only (raises if the arena is not reachable); ``"bulk"`` — side channel,
  never shm; ``"grpc"`` — pure gRPC streams of ~1 MiB chunks (what a client behind a proxy uses).

Failure model: every failure to reach the daemon in time — refused, reset, deadline — raises
``DaemonUnavailable`` (connectors treat it as a miss and recompute). Idempotent calls (all of them:
puts are content-addressed) are retried on UNAVAILABLE with short backoff inside the deadline. Any
other error comes back as the same ``kvstore.errors`` class the daemon raised, naming the field.

Correctness of the shm path: a load copies out of the arena while its blocks are pinned by a lease,
then ``CompleteLoad``; if the lease had expired (a stalled client), the blocks are reported as
misses because their slots may have been reused. A store stops writing and aborts when its lease is
close to expiry.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import errors
from kvstore.errors import CodecError, DaemonUnavailable, InvalidArgument, KVStoreError, WrongBlockSize
from kvstore.buffers import as_bytes
from kvstore.keys import KVLayout, Namespace
from kvstore.wire import (DEFAULT_URL, MAX_BATCH, MAX_LOOKUP_BATCH, SERVER_ID_KEY, UNSTAGED_KEY,  # noqa: F401
                          Lookup)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.transport import chunks, shm
from kvstore.transport.bulk import BulkChannel

TRANSPORTS = ("auto", "shm", "bulk", "grpc")
_PUT_RESULT = {pb.PUT_STORED: "stored", pb.PUT_EXISTS: "exists", pb.PUT_PERSISTED: "persisted"}
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_SLOW_LINK_BYTES_PER_S = 100e6   # deadline allowance per byte for bulk calls


class RemoteError(KVStoreError):
    """An error status the daemon did not attach a kvstore class to (e.g. gRPC's own limits)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.grpc_status = code.name
        super().__init__(f"{code.name}: {message}")


class _DaemonRestarted(DaemonUnavailable):
    """A lease came from another daemon run than the arena we mapped (handled inside Client)."""


def _error_from_rpc(e: grpc.RpcError) -> KVStoreError:
    """The kvstore exception a failed RPC stands for."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    meta = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    name = meta.get("kvstore-error")
    cls = getattr(errors, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, KVStoreError):
        err = cls.__new__(cls)
        Exception.__init__(err, details)
        if meta.get("kvstore-field"):
            err.field = meta["kvstore-field"]
        return err
    if code in _UNREACHABLE:
        return DaemonUnavailable(f"kvstore daemon unreachable ({code.name}): {details}")
    return RemoteError(code, details)


def _decode(codec: int, payload: np.ndarray, layout: KVLayout | None) -> np.ndarray:
    """Turn a payload that arrived encoded (its block says which codec) into the raw block bytes
    with kvstore.codecs, here on the client. Today's daemons decode before sending (the wire
    carries raw blocks); an encoded block for a namespace this client never registered is refused
    rather than handed over as wrong bytes."""
    if codec == 0:
        return payload
    if layout is None:
        raise CodecError(f"codec: block stored with codec {codec} for a namespace this client did not "
                         "register; cannot decode it")
    from kvstore import codecs
    return codecs.decode_block(codec, payload, layout).numpy()


def _parse_url(url: str | None) -> tuple[str, bool]:
    url = url or os.environ.get("KVSTORE_URL") or DEFAULT_URL
    tls = False
    for prefix, secure in (("grpcs://", True), ("grpc://", False), ("http://", False), ("https://", True)):
        if url.startswith(prefix):
            url, tls = url[len(prefix):], secure
    if ":" not in url:
        raise InvalidArgument("url", f"{url!r} is not HOST:PORT")
    return url.rstrip("/"), tls


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 5.0,
                 transport: str = "auto", retries: int = 2, root_ca: str | None = None,
                 chunk_bytes: int | None = None) -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument("transport", f"one of {TRANSPORTS}, got {transport!r}")
        self.address, tls = _parse_url(url)
        self.host = self.address.rpartition(":")[0].strip("[]")
        self.timeout_s = timeout_s
        self.transport = transport
        self.retries = retries
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.enable_retries", 0)]
        if tls or root_ca:
            ca = open(root_ca, "rb").read() if root_ca else None
            self._channel = grpc.secure_channel(self.address, grpc.ssl_channel_credentials(ca), options)
        else:
            self._channel = grpc.insecure_channel(self.address, options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._chunk_bytes = chunk_bytes
        self._block_bytes: dict[bytes, int] = {}
        self._layouts: dict[bytes, KVLayout] = {}
        self._lock = threading.Lock()
        self._negotiated = False
        self._server_id: str | None = None
        self._arena: shm.ArenaMap | None = None
        self._bulk: BulkChannel | None = None
        self._closed = False
        self._pending: list = []   # background CompleteLoad calls

    # -- plumbing --------------------------------------------------------------------------------

    def _call_same_daemon(self, method: str, request):
        """A lease RPC whose answer holds arena offsets: valid only if the daemon run that answered
        is the one whose arena we mapped. A daemon restarted behind the same address (the channel
        reconnects silently) has a new arena; using its offsets in the old mapping would hand out
        wrong bytes, so that raises ``_DaemonRestarted`` and the caller renegotiates."""
        resp, call = self._call(method, request, with_call=True)
        meta = dict(call.trailing_metadata() or ())
        answered_by = meta.get(SERVER_ID_KEY)
        if answered_by != self._server_id:
            if method == "PrepareLoad":
                release = ("CompleteLoad", pb.LeaseRequest(lease_id=resp.lease_id))
            else:
                release = ("AbortStore", pb.LeaseRequest(lease_id=resp.lease_id))
            try:
                self._call(*release)
            except KVStoreError:
                pass  # it expires on its own
            self._reset_transport()
            raise _DaemonRestarted(f"the daemon at {self.address} restarted (run {answered_by}, "
                                   f"mapped {self._server_id})")
        return resp, meta

    def _call(self, method: str, request, timeout_s: float | None = None, stream_factory=None,
              with_call: bool = False):
        """One RPC with retries on UNAVAILABLE inside the deadline; raises kvstore errors."""
        if self._closed:
            raise DaemonUnavailable("client is closed")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        fn = getattr(self._stub, method)
        if with_call:
            fn = fn.with_call
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                req = stream_factory() if stream_factory else request
                return fn(req, timeout=max(remaining, 0.001), metadata=self._metadata)
            except grpc.RpcError as e:
                err = _error_from_rpc(e)
                if (isinstance(err, DaemonUnavailable) and e.code() == grpc.StatusCode.UNAVAILABLE
                        and attempt < self.retries and deadline - time.monotonic() > 0.05):
                    attempt += 1
                    time.sleep(min(0.05 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
                    continue
                if isinstance(err, DaemonUnavailable):
                    self._reset_transport()
                raise err from None

    def _data_timeout(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / _SLOW_LINK_BYTES_PER_S

    def _reset_transport(self) -> None:
        """Forget the negotiated transport (the daemon may have restarted with a new arena)."""
        with self._lock:
            self._negotiated = False
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            if self._bulk is not None:
                self._bulk.close()
                self._bulk = None

    def _negotiate(self) -> None:
        if self._negotiated:
            return
        nonce = secrets.token_bytes(16)
        hs = self._call("Handshake", pb.HandshakeRequest(nonce=nonce, client_version=1))
        with self._lock:
            if self._negotiated:
                return
            self._server_id = hs.server_id
            if self._chunk_bytes is None:
                self._chunk_bytes = hs.chunk_bytes or chunks.DEFAULT_CHUNK_BYTES
            arena = None
            if self.transport in ("auto", "shm") and hs.arena_path and shm.nonce_is_local(hs.probe_path, nonce):
                try:
                    arena = shm.ArenaMap(hs.arena_path, hs.arena_bytes, hs.arena_dev, hs.arena_ino)
                except OSError:
                    arena = None
            if self.transport == "shm" and arena is None:
                raise InvalidArgument("transport", "shm was requested but the daemon's arena is not "
                                                   "reachable from this process (another host, or no CPU tier)")
            self._arena = arena
            if arena is None and self.transport in ("auto", "bulk") and hs.bulk_port:
                try:
                    self._bulk = BulkChannel(self.host, hs.bulk_port, hs.bulk_ticket, self.timeout_s)
                except OSError:
                    self._bulk = None
            self._negotiated = True

    @property
    def active_transport(self) -> str:
        """What data calls use now: "shm", "bulk" or "grpc"."""
        self._negotiate()
        return "shm" if self._arena is not None else "bulk" if self._bulk is not None else "grpc"

    def _expected(self, ns_id: bytes) -> int:
        return self._block_bytes.get(bytes(ns_id), 0)

    @staticmethod
    def _batches(n: int, size: int = MAX_BATCH):
        return ((i, min(i + size, n)) for i in range(0, n, size))

    # -- control ---------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the daemon answers SERVING; False when it is down, stopping or unreachable."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def register_namespace(self, ns: Namespace) -> bytes:
        layout = pb.Layout(**ns.layout.to_dict())
        resp = self._call("RegisterNamespace", pb.RegisterNamespaceRequest(
            layout=layout, cache_salt=ns.cache_salt, tenant=ns.tenant))
        ns_id = bytes(resp.namespace_id)
        self._block_bytes[ns_id] = resp.block_bytes
        self._layouts[ns_id] = ns.layout
        return ns_id

    def lookup(self, ns_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> Lookup:
        """Leading blocks of the chain present in the daemon (pinned for the lease time)."""
        hit, tiers = 0, []
        for a, b in self._batches(len(hashes)):
            r = self._call("Lookup", pb.LookupRequest(namespace_id=ns_id, hashes=hashes[a:b], no_lease=not lease))
            hit += r.num_hit
            tiers += list(r.tiers)
            if r.num_hit < b - a:
                break
        return Lookup(hit, tiers)

    def lookup_many(self, ns_id: bytes, chains: Sequence[Sequence[bytes]], lease: bool = True) -> list[Lookup]:
        """Many chains in one RPC (batched scheduling: thousands of lookups per second)."""
        out = []
        for a, b in self._batches(len(chains), MAX_LOOKUP_BATCH):
            req = pb.LookupBatchRequest(requests=[pb.LookupRequest(namespace_id=ns_id, hashes=c, no_lease=not lease)
                                                  for c in chains[a:b]])
            out += [Lookup(r.num_hit, list(r.tiers)) for r in self._call("LookupBatch", req).responses]
        return out

    def exists(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for a, b in self._batches(len(hashes)):
            out += list(self._call("Exists", pb.ExistsRequest(namespace_id=ns_id, hashes=hashes[a:b])).present)
        return out

    def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        return sum(self._call("Delete", pb.DeleteRequest(namespace_id=ns_id, hashes=hashes[a:b])).deleted
                   for a, b in self._batches(len(hashes)))

    def stats(self) -> dict:
        self._settle_pending()
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def route(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[dict]:
        """Fleet mode: per node, how many leading blocks of this chain it holds, longest first."""
        resp = self._call("Route", pb.RouteRequest(namespace_id=ns_id, hashes=list(hashes)))
        return [{"node_id": n.node_id, "address": n.address, "blocks": n.blocks, "tokens": n.tokens,
                 "memory_blocks": n.memory_blocks, "disk_blocks": n.disk_blocks} for n in resp.nodes]

    # -- put -------------------------------------------------------------------------------------

    def put(self, ns_id: bytes, hashes: Sequence[bytes], blocks: Sequence, parent: bytes | None = None) -> list[str]:
        """Store a chain of blocks; per block "stored", "exists" or "persisted"."""
        if len(blocks) != len(hashes):
            raise InvalidArgument("blocks", f"{len(blocks)} blocks for {len(hashes)} hashes")
        arrays = [as_bytes(b) for b in blocks]
        want = self._expected(ns_id)
        for i, a in enumerate(arrays):
            if want and a.nbytes != want:
                raise WrongBlockSize(want, a.nbytes, i)
        self._negotiate()
        results: list[str] = []
        for a, b in self._batches(len(hashes)):
            p = parent if a == 0 else hashes[a - 1]
            results += self._put_batch(ns_id, list(hashes[a:b]), arrays[a:b], p)
        return results

    def _put_batch(self, ns_id, hashes, arrays, parent) -> list[str]:
        block_bytes = arrays[0].nbytes if arrays else 0
        if self._arena is not None:
            try:
                return self._put_shm(ns_id, hashes, arrays, parent, block_bytes)
            except errors.TierFull:
                pass  # the arena is full of pinned blocks: the streaming paths can land lower down
            except _DaemonRestarted:
                self._negotiate()  # map the new daemon's arena (or fall back), then go on below
                if self._arena is not None:
                    return self._put_shm(ns_id, hashes, arrays, parent, block_bytes)
        bulk = self._bulk
        if bulk is not None:
            return self._put_bulk(bulk, ns_id, hashes, arrays, parent, block_bytes)
        header = pb.PutHeader(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes)
        resp = self._call("Put", None, self._data_timeout(block_bytes * len(arrays)),
                          stream_factory=lambda: chunks.put_messages(header, arrays, self._chunk_bytes))
        return [_PUT_RESULT[r] for r in resp.results]

    def _put_shm(self, ns_id, hashes, arrays, parent, block_bytes) -> list[str]:
        t0 = time.monotonic()
        lease, _ = self._call_same_daemon("PrepareStore", pb.PrepareStoreRequest(
            namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes))
        safe_until = t0 + 0.8 * lease.expires_in
        try:
            for blk, src in zip(lease.blocks, arrays):
                if blk.present:
                    continue
                if time.monotonic() > safe_until:
                    raise errors.LeaseExpired("lease_id: the store lease ran out while copying; aborted")
                self._arena.copy_in([(e.offset, e.length) for e in blk.extents], src)
        except BaseException:
            try:
                self._call("AbortStore", pb.LeaseRequest(lease_id=lease.lease_id))
            except KVStoreError:
                pass  # the lease expires on its own
            raise
        resp = self._call("CompleteStore", pb.LeaseRequest(lease_id=lease.lease_id))
        return [_PUT_RESULT[r] for r in resp.results]

    def _put_bulk(self, bulk: BulkChannel, ns_id, hashes, arrays, parent, block_bytes) -> list[str]:
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes,
                             session=bulk.session)
        timeout = self._data_timeout(block_bytes * len(arrays))
        with bulk.lock:
            fut = self._stub.BulkPut.future(req, timeout=timeout, metadata=self._metadata)
            try:
                for a in arrays:
                    bulk.send(a)
                return [_PUT_RESULT[r] for r in fut.result().results]
            except grpc.RpcError as e:
                err = _error_from_rpc(e)
                if isinstance(err, DaemonUnavailable) or getattr(err, "field", None) == "session":
                    self._reset_transport()
                raise err from None
            except OSError as e:
                fut.cancel()
                self._reset_transport()
                raise DaemonUnavailable(f"side channel failed: {e}") from None

    # -- get -------------------------------------------------------------------------------------

    def get_into(self, ns_id: bytes, hashes: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Copy each block into the writable buffer ``outs[i]``; its size, or None for a miss."""
        if len(outs) != len(hashes):
            raise InvalidArgument("outs", f"{len(outs)} buffers for {len(hashes)} hashes")
        dsts = [as_bytes(o) for o in outs]
        want = self._expected(ns_id)
        for i, d in enumerate(dsts):
            if want and d.nbytes < want:
                raise InvalidArgument(f"outs[{i}]", f"buffer of {d.nbytes} bytes; blocks are {want} bytes")
            if not d.flags.writeable:
                raise InvalidArgument(f"outs[{i}]", "buffer is read-only")
        self._negotiate()
        sizes: list[int | None] = []
        for a, b in self._batches(len(hashes)):
            sizes += self._get_batch(ns_id, list(hashes[a:b]), dsts[a:b])
        return sizes

    def get(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[bytes | None]:
        want = self._expected(ns_id)
        if not want:
            raise InvalidArgument("namespace_id", "unknown to this client; call register_namespace first")
        outs = [np.empty(want, dtype=np.uint8) for _ in hashes]
        sizes = self.get_into(ns_id, hashes, outs)
        return [None if n is None else o[:n].tobytes() for o, n in zip(outs, sizes)]

    def _deliver(self, ns_id: bytes, codec: int, payload: np.ndarray, dst: np.ndarray) -> int:
        raw = _decode(codec, payload, self._layouts.get(bytes(ns_id)))
        if raw is not dst[:raw.nbytes]:
            np.copyto(dst[:raw.nbytes], raw)
        return raw.nbytes

    def _get_batch(self, ns_id, hashes, dsts) -> list[int | None]:
        if self._arena is not None:
            try:
                return self._get_shm(ns_id, hashes, dsts)
            except _DaemonRestarted:
                self._negotiate()  # map the new daemon's arena (or fall back), then go on below
                if self._arena is not None:
                    return self._get_shm(ns_id, hashes, dsts)
        bulk = self._bulk
        if bulk is not None:
            return self._get_bulk(bulk, ns_id, hashes, dsts)
        return self._get_grpc(ns_id, hashes, dsts)

    def _get_shm(self, ns_id, hashes, dsts) -> list[int | None]:
        sizes: list[int | None] = [None] * len(hashes)
        start = 0
        while start < len(hashes):
            self._settle_pending()  # our previous pins are released before we pin more (small arenas)
            t0 = time.monotonic()
            lease, meta = self._call_same_daemon("PrepareLoad", pb.PrepareLoadRequest(
                namespace_id=ns_id, hashes=hashes[start:], block_bytes=self._expected(ns_id)))
            got = []
            try:
                for k, blk in enumerate(lease.blocks):
                    i = start + k
                    extents = [(e.offset, e.length) for e in blk.extents]
                    if blk.codec == 0 and blk.size <= dsts[i].nbytes:
                        got.append((i, self._arena.copy_out(extents, dsts[i])))
                    else:
                        tmp = np.empty(sum(n for _, n in extents), dtype=np.uint8)
                        self._arena.copy_out(extents, tmp)
                        got.append((i, self._deliver(ns_id, blk.codec, tmp, dsts[i])))
            finally:
                # The daemon started the lease after t0, so a copy that ended before t0 + expires_in
                # ran entirely under the pins: release them without waiting for the answer (one
                # round trip less per get). A slower copy is trusted only if the daemon confirms.
                if time.monotonic() < t0 + lease.expires_in:
                    self._release_load_async(lease.lease_id)
                    confirmed = True
                else:
                    try:
                        self._call("CompleteLoad", pb.LeaseRequest(lease_id=lease.lease_id))
                        confirmed = True
                    except errors.LeaseExpired:
                        confirmed = False  # slots may have been reused while we copied: report misses
            if confirmed:
                for i, n in got:
                    sizes[i] = n
            stop = start + len(lease.blocks)
            if meta.get(UNSTAGED_KEY) and stop < len(hashes):
                # present, but the arena had no free unpinned slot: stream it rather than miss
                sizes[stop] = self._get_grpc(ns_id, [hashes[stop]], [dsts[stop]])[0]
            start = stop + 1  # skip past the first miss
        return sizes

    def _release_load_async(self, lease_id: int) -> None:
        """CompleteLoad in the background; a lost one only means the pins last until the lease ends."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._stub.CompleteLoad.future(pb.LeaseRequest(lease_id=lease_id),
                                                            timeout=self.timeout_s, metadata=self._metadata))

    def _get_bulk(self, bulk: BulkChannel, ns_id, hashes, dsts) -> list[int | None]:
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, block_bytes=self._expected(ns_id),
                             session=bulk.session)
        timeout = self._data_timeout(sum(d.nbytes for d in dsts))
        sizes: list[int | None] = []
        with bulk.lock:
            fut = self._stub.BulkGet.future(req, timeout=timeout, metadata=self._metadata)
            try:
                bulk.wait_readable(fut, time.monotonic() + timeout)
                for dst in dsts:
                    size = bulk.read_size()
                    if size is None:
                        fut.result()  # raises the daemon's error
                        raise DaemonUnavailable("side channel reported an error the RPC did not")
                    if size > dst.nbytes:
                        raise InvalidArgument("outs", f"block of {size} bytes does not fit a {dst.nbytes}-byte buffer")
                    if size:
                        bulk.recv_into(dst[:size])
                    sizes.append(size or None)
                resp = fut.result()
                for i, codec in enumerate(resp.codecs):  # encoded blocks: decode in place (hook)
                    if codec and sizes[i]:
                        sizes[i] = self._deliver(ns_id, codec, dsts[i][:sizes[i]].copy(), dsts[i])
            except grpc.RpcError as e:
                err = _error_from_rpc(e)
                if isinstance(err, DaemonUnavailable) or getattr(err, "field", None) == "session":
                    self._reset_transport()
                raise err from None
            except (OSError, TimeoutError, InvalidArgument) as e:
                fut.cancel()
                self._reset_transport()  # the socket is mid-frame: start a fresh one next time
                if isinstance(e, InvalidArgument):
                    raise
                raise DaemonUnavailable(f"side channel failed: {e}") from None
        return sizes

    def _get_grpc(self, ns_id, hashes, dsts) -> list[int | None]:
        sizes: list[int | None] = [None] * len(hashes)
        req = pb.GetRequest(namespace_id=ns_id, hashes=hashes, block_bytes=self._expected(ns_id),
                            chunk_bytes=self._chunk_bytes or 0)
        timeout = self._data_timeout(sum(d.nbytes for d in dsts))
        pending: dict[int, np.ndarray] = {}
        stream = self._call("Get", req, timeout)
        try:
            for c in stream:
                if not c.hit:
                    continue
                dst = dsts[c.index]
                if c.codec == 0:
                    if c.size > dst.nbytes:
                        raise InvalidArgument("outs", f"block of {c.size} bytes does not fit a {dst.nbytes}-byte buffer")
                    dst[c.offset:c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)
                    if c.offset + len(c.data) >= c.size:
                        sizes[c.index] = c.size
                else:  # encoded: gather, then decode once complete
                    buf = pending.setdefault(c.index, np.empty(c.size, dtype=np.uint8))
                    buf[c.offset:c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)
                    if c.offset + len(c.data) >= c.size:
                        sizes[c.index] = self._deliver(ns_id, c.codec, pending.pop(c.index), dst)
        except grpc.RpcError as e:
            err = _error_from_rpc(e)
            if isinstance(err, DaemonUnavailable):
                self._reset_transport()
            raise err from None
        return sizes

    # -- lifetime --------------------------------------------------------------------------------

    def _settle_pending(self) -> None:
        """Wait for background releases, so what this client observes next includes them."""
        for f in self._pending:
            try:
                f.result()
            except grpc.RpcError:
                pass
        self._pending = []

    def close(self) -> None:
        if self._closed:
            return
        self._settle_pending()
        self._reset_transport()
        self._closed = True
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio façade over ``Client``: each call runs on a small thread pool, so many calls can be
    in flight from one event loop while bulk copies (numpy, sockets) release the GIL."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 5.0,
                 transport: str = "auto", max_in_flight: int = 8, **kwargs) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._client = Client(url, token=token, timeout_s=timeout_s, transport=transport, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="kvstore-async")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def register_namespace(self, ns: Namespace) -> bytes:
        return await self._run(self._client.register_namespace, ns)

    async def lookup(self, ns_id, hashes, lease: bool = True) -> Lookup:
        return await self._run(self._client.lookup, ns_id, hashes, lease)

    async def lookup_many(self, ns_id, chains, lease: bool = True) -> list[Lookup]:
        return await self._run(self._client.lookup_many, ns_id, chains, lease)

    async def exists(self, ns_id, hashes) -> list[bool]:
        return await self._run(self._client.exists, ns_id, hashes)

    async def put(self, ns_id, hashes, blocks, parent=None) -> list[str]:
        return await self._run(self._client.put, ns_id, hashes, blocks, parent)

    async def get_into(self, ns_id, hashes, outs) -> list[int | None]:
        return await self._run(self._client.get_into, ns_id, hashes, outs)

    async def get(self, ns_id, hashes) -> list[bytes | None]:
        return await self._run(self._client.get, ns_id, hashes)

    async def delete(self, ns_id, hashes) -> int:
        return await self._run(self._client.delete, ns_id, hashes)

    async def stats(self) -> dict:
        return await self._run(self._client.stats)

    async def route(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[dict]:
        return await self._run(self._client.route, ns_id, hashes)

    async def health(self) -> bool:
        return await self._run(self._client.health)

    @property
    def active_transport(self) -> str:
        return self._client.active_transport

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

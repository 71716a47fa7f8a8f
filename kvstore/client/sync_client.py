"""``Client``: the blocking client of one daemon (control calls, and puts / gets by transport).

    c = Client("127.0.0.1:7373", token=None, timeout_s=5.0, transport="auto")
    ns_id = c.register_namespace(Namespace(layout, cache_salt="..."))
    c.put(ns_id, hashes, blocks)            # bytes / numpy / CPU torch tensors
    c.put(ns_id, hashes, gpu_blocks, encode="fp8")   # encoded here, on the tensors' device
    sizes = c.get_into(ns_id, hashes, outs)  # None = miss; outs may be CUDA tensors

Requests are checked here (sizes, writable buffers) before anything moves, cut into batches of
the wire's limits, and sent over the negotiated transport (``kvstore.client.negotiation``).
Blocks the daemon stores encoded arrive as stored and are decoded here, into the caller's buffer
on its device (``compressed_transfer=False``: the daemon decodes them instead).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from kvstore import errors
from kvstore.buffers import as_bytes
from kvstore.client.delivery import IntoBuffer, KeepPayload, LandingPool
from kvstore.client.negotiation import Negotiation
from kvstore.client.rpc import RpcChannel
from kvstore.client.rpc_errors import DaemonRestarted
from kvstore.client.shm_path import ShmPath
from kvstore.client.stream_paths import BulkPath, GrpcPath
from kvstore.errors import InvalidArgument, WrongBlockSize
from kvstore.keys import Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport.local_lookup import CallFailed, Unframeable
from kvstore.wire import MAX_BATCH, MAX_LOOKUP_BATCH, MAX_LOOKUP_HASHES, Lookup


def batches(n: int, size: int = MAX_BATCH):
    """``(start, stop)`` ranges covering ``n`` items, at most ``size`` each."""
    return ((i, min(i + size, n)) for i in range(0, n, size))


def chain_batches(chains: Sequence[Sequence[bytes]]):
    """``(start, stop)`` ranges of ``chains`` that each fit one LookupBatch (chains and hashes)."""
    start = 0
    while start < len(chains):
        stop, total = start, 0
        while stop < len(chains) and stop - start < MAX_LOOKUP_BATCH and \
                (stop == start or total + len(chains[stop]) <= MAX_LOOKUP_HASHES):
            total += len(chains[stop])
            stop += 1
        yield start, stop
        start = stop


def _nbytes(block) -> int:
    if type(block).__module__.startswith("torch"):
        return block.numel() * block.element_size()
    return as_bytes(block).nbytes


def _host_bytes(block, index: int) -> np.ndarray:
    """A block's bytes in host memory (a device tensor is copied back: it is sent raw)."""
    if type(block).__module__.startswith("torch") and block.device.type != "cpu":
        import torch
        return block.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return as_bytes(block, f"blocks[{index}]")


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 5.0,
                 transport: str = "auto", retries: int = 2, root_ca: str | None = None,
                 chunk_bytes: int | None = None, compressed_transfer: bool = True, lookup_index: bool = True,
                 local_leases: bool = True, interceptors: tuple = ()) -> None:
        """``compressed_transfer``: take blocks the daemon stores encoded as stored and decode them
        here (fewer bytes on the wire; needs torch), instead of having the daemon decode them.
        ``lookup_index``: on the daemon's host, answer lookups from its mapped lookup index
        (``transport.lookup_index``) rather than asking over its Unix socket each time.
        ``local_leases``: make the shm path's lease calls over that socket (``transport.local_calls``)
        when the daemon offers it; False keeps them on gRPC (what the benchmark compares).
        ``interceptors``: gRPC client interceptors for every call (a fleet daemon's peer proofs)."""
        self._rpc = RpcChannel(url, token, timeout_s, retries, root_ca, tuple(interceptors))
        self._negotiation = Negotiation(self._rpc, transport, chunk_bytes, compressed_transfer, lookup_index,
                                        local_leases)
        self._grpc = GrpcPath(self._negotiation)
        self._bulk = BulkPath(self._negotiation)
        self._shm = ShmPath(self._negotiation, stream_one=self._get_streamed, stream_put=self._put_streamed)
        self._block_bytes: dict[bytes, int] = {}
        self._layouts: dict = {}   # namespace id -> KVLayout, for decoding blocks sent as stored
        self._landing = LandingPool()
        self._closed = False

    @property
    def address(self) -> str:
        return self._rpc.address

    @property
    def host(self) -> str:
        return self._rpc.host

    @property
    def timeout_s(self) -> float:
        return self._rpc.timeout_s

    @property
    def transport(self) -> str:
        """What was asked for ("auto", "shm", "bulk" or "grpc"); ``active_transport`` is what runs."""
        return self._negotiation.transport

    @property
    def active_transport(self) -> str:
        """What data calls use now: "shm", "bulk" or "grpc"."""
        return self._negotiation.active

    @property
    def server_id(self) -> str | None:
        """The daemon run this client negotiated with (None before the first data call)."""
        return self._negotiation.server_id

    @property
    def fleet_node(self) -> str:
        """The node id the daemon goes by in its fleet ("" when fleet mode is off there)."""
        self._negotiation.ensure()
        return self._negotiation.fleet_node

    @property
    def mapped_arena(self):
        """The daemon's arena as this process mapped it (a ``transport.shm.ArenaMap``, or with auth
        on a ``transport.segments.SegmentMap`` of this tenant's segments), or None when data does
        not move through shared memory."""
        self._negotiation.ensure()
        return self._negotiation.arena

    @property
    def channel(self):
        """The gRPC channel, for tools that speak the raw protocol (e.g. with their own metadata)."""
        return self._rpc.channel

    def call(self, method: str, request, timeout_s: float | None = None):
        """One raw RPC by method name, with this client's token, retries and error mapping (tools
        and fault-injection tests drive lease RPCs with it)."""
        return self._rpc.call(method, request, timeout_s)

    def _expected(self, ns_id: bytes) -> int:
        return self._block_bytes.get(bytes(ns_id), 0)

    # -- control ---------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the daemon answers SERVING; False when it is down, stopping or unreachable."""
        return self._rpc.health()

    def register_namespace(self, ns: Namespace) -> bytes:
        layout = pb.Layout(**ns.layout.to_dict())
        resp = self._rpc.call("RegisterNamespace", pb.RegisterNamespaceRequest(
            layout=layout, cache_salt=ns.cache_salt, tenant=ns.tenant))
        ns_id = bytes(resp.namespace_id)
        self._block_bytes[ns_id] = resp.block_bytes
        if resp.block_bytes == ns.layout.block_bytes:
            self._layouts[ns_id] = ns.layout
        return ns_id

    def lookup(self, ns_id: bytes, hashes: Sequence[bytes], lease: bool = True, producer: str = "",
               local_only: bool = False) -> Lookup:
        """Leading blocks of the chain present in the daemon (pinned for the lease time). A fleet
        daemon completes a short local run from its peers, unless ``local_only``; ``producer``:
        the fleet node id a P/D hand-off names as the blocks' producer, which a fleet daemon
        fetches what it misses from directly (``LookupRequest.producer``). On the daemon's host a
        lookup the daemon answers from its own blocks goes over its Unix socket
        (``transport.local_lookup``), else gRPC."""
        self._negotiation.ensure()
        from_own_blocks = local_only or not self._negotiation.fleet_node
        for _ in range(2):   # a connection the daemon let go is connected again, once, at once
            local = self._negotiation.local_lookups() if from_own_blocks else None
            if local is None or not hashes:
                break
            try:
                return self._lookup_with(lambda h: local.lookup(ns_id, h, lease), hashes)
            except (CallFailed, Unframeable):
                break   # refused, or not for the socket: the RPC below answers, or raises the same error
            except (OSError, ValueError):
                self._negotiation.drop_local_lookups()

        def rpc(h):
            r = self._rpc.call("Lookup", pb.LookupRequest(namespace_id=ns_id, hashes=h, no_lease=not lease,
                                                          producer=producer, local_only=local_only))
            return r.num_hit, list(r.tiers)
        return self._lookup_with(rpc, hashes)

    @staticmethod
    def _lookup_with(ask, hashes: Sequence[bytes]) -> Lookup:
        hit, tiers = 0, []
        for a, b in batches(len(hashes)):
            n, t = ask(list(hashes[a:b]))
            hit += n
            tiers += t
            if n < b - a:
                break
        return Lookup(hit, tiers)

    def lookup_many(self, ns_id: bytes, chains: Sequence[Sequence[bytes]], lease: bool = True) -> list[Lookup]:
        """Many chains in one RPC (batched scheduling: thousands of lookups per second)."""
        out = []
        for a, b in chain_batches(chains):
            req = pb.LookupBatchRequest(requests=[pb.LookupRequest(namespace_id=ns_id, hashes=c, no_lease=not lease)
                                                  for c in chains[a:b]])
            out += [Lookup(r.num_hit, list(r.tiers)) for r in self._rpc.call("LookupBatch", req).responses]
        return out

    def exists(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for a, b in batches(len(hashes)):
            out += list(self._rpc.call("Exists", pb.ExistsRequest(namespace_id=ns_id, hashes=hashes[a:b])).present)
        return out

    def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        return sum(self._rpc.call("Delete", pb.DeleteRequest(namespace_id=ns_id, hashes=hashes[a:b])).deleted
                   for a, b in batches(len(hashes)))

    def stats(self) -> dict:
        self._shm.settle()
        return json.loads(self._rpc.call("Stats", pb.StatsRequest()).json)

    def route(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[dict]:
        """Fleet mode: per node, how many leading blocks of this chain it holds, longest first."""
        resp = self._rpc.call("Route", pb.RouteRequest(namespace_id=ns_id, hashes=list(hashes)))
        return [{"node_id": n.node_id, "address": n.address, "blocks": n.blocks, "tokens": n.tokens,
                 "memory_blocks": n.memory_blocks, "disk_blocks": n.disk_blocks} for n in resp.nodes]

    # -- put -------------------------------------------------------------------------------------

    def put(self, ns_id: bytes, hashes: Sequence[bytes], blocks: Sequence, parent: bytes | None = None,
            encode: str | None = None) -> list[str]:
        """Store a chain of blocks; per block "stored", "exists" or "persisted".

        ``encode``: a codec name ("fp8", "int4_g64", "zstd", ...; None or "raw": send the blocks
        as they are). Each block is encoded here, on the device it lives on (a CUDA tensor on its
        GPU: only the payload crosses PCIe), and only the payload is sent. The daemon checks it
        against the namespace's layout and keeps it as it is where its tier stores that codec,
        decoding (and re-encoding) it where the tier keeps another form; it reads back exactly as a
        block the daemon encoded itself. A block the codec cannot encode (NaN/Inf, a layout it does
        not read, no gain) is sent raw. The namespace must be registered with this client."""
        if len(blocks) != len(hashes):
            raise InvalidArgument("blocks", f"{len(blocks)} blocks for {len(hashes)} hashes")
        want = self._expected(ns_id)
        if encode is not None and encode != "raw":
            codec, arrays = self._encoded(ns_id, blocks, encode)
        else:
            codec, arrays = 0, [as_bytes(b) for b in blocks]
            for i, a in enumerate(arrays):
                if want and a.nbytes != want:
                    raise WrongBlockSize(want, a.nbytes, i)
        block_bytes = want or (arrays[0].nbytes if arrays else 0)
        self._negotiation.ensure()
        results: list[str] = []
        for a, b in batches(len(hashes)):
            p = parent if a == 0 else hashes[a - 1]
            results += self._put_batch(ns_id, list(hashes[a:b]), arrays[a:b], p, block_bytes, codec)
        return results

    def _encoded(self, ns_id: bytes, blocks: Sequence, encode: str) -> tuple[int, list[np.ndarray]]:
        """(codec id, per block its payload, or the raw block where the codec refused it)."""
        layout = self._layouts.get(bytes(ns_id))
        if layout is None:
            raise InvalidArgument("encode", "needs the namespace's layout: register the namespace with this "
                                            "client first")
        from kvstore import codecs
        try:
            codec = codecs.get_codec(encode)
        except errors.CodecError as e:
            raise InvalidArgument("encode", str(e)) from None
        try:
            codecs.check_layout(codec.codec_id, layout)
            readable = True
        except codecs.Refused:   # a layout the codec does not read: raw, as the daemon would keep it
            readable = False
        arrays = []
        for i, block in enumerate(blocks):
            nbytes = _nbytes(block)
            if nbytes != layout.block_bytes:
                raise WrongBlockSize(layout.block_bytes, nbytes, i)
            if readable:
                try:
                    payload = codecs.encode_block(codec.codec_id, block, layout)[1]
                    if payload.nbytes < layout.block_bytes:
                        arrays.append(payload)
                        continue
                except codecs.Refused:   # NaN/Inf: this block goes raw
                    pass
            arrays.append(_host_bytes(block, i))
        return codec.codec_id, arrays

    def _put_batch(self, ns_id, hashes, arrays, parent, block_bytes: int, codec: int = 0) -> list[str]:
        if self._negotiation.arena is not None:
            try:   # an arena full of pinned blocks streams the rest (``_put_streamed``): it can land lower down
                return self._shm.put(ns_id, hashes, arrays, parent, block_bytes, codec)
            except DaemonRestarted:
                self._negotiation.ensure()  # map the new daemon's arena (or fall back), then go on below
                if self._negotiation.arena is not None:
                    return self._shm.put(ns_id, hashes, arrays, parent, block_bytes, codec)
        return self._put_streamed(ns_id, hashes, arrays, parent, block_bytes, codec)

    def _put_streamed(self, ns_id, hashes, arrays, parent, block_bytes: int, codec: int = 0) -> list[str]:
        """A put over the side channel when there is one, else over gRPC chunks."""
        bulk = self._negotiation.live_bulk()
        if bulk is not None:
            return self._bulk.put(bulk, ns_id, hashes, arrays, parent, block_bytes, codec)
        return self._grpc.put(ns_id, hashes, arrays, parent, block_bytes, codec)

    # -- get -------------------------------------------------------------------------------------

    def get_into(self, ns_id: bytes, hashes: Sequence[bytes], outs: Sequence,
                 byte_range: tuple[int, int] | None = None) -> list[int | None]:
        """Copy each block into the writable buffer ``outs[i]`` (bytes-like, numpy, or a torch
        tensor on any device); its size, or None for a miss. ``byte_range`` (offset, length):
        only those bytes of each block (one layer's slice of it, say), which then are all that
        crosses the wire; ``outs[i]`` need only hold ``length`` bytes."""
        if len(outs) != len(hashes):
            raise InvalidArgument("outs", f"{len(outs)} buffers for {len(hashes)} hashes")
        want, layout = self._expected(ns_id), self._layouts.get(bytes(ns_id))
        if byte_range is not None:
            byte_range = self._checked_range(byte_range, want)
            want, layout = byte_range[1], None   # raw bytes of the block: the daemon decodes
        sinks = [IntoBuffer(o, i, want, layout, self._landing) for i, o in enumerate(outs)]
        return self._get_sinks(ns_id, hashes, sinks, byte_range)

    @staticmethod
    def _checked_range(byte_range: tuple[int, int], block_bytes: int) -> tuple[int, int]:
        offset, length = (int(x) for x in byte_range)
        if offset < 0 or length <= 0 or (block_bytes and offset + length > block_bytes):
            raise InvalidArgument("byte_range", f"({offset}, {length}) is not a non-empty range inside a "
                                                f"{block_bytes}-byte block")
        return offset, length

    def get_payloads(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[tuple[int, np.ndarray] | None]:
        """Each block as the daemon stores it: ``(codec id, payload)`` (codec 0: the block itself),
        or None for a miss. A fleet peer keeps such payloads as they are, so they match the
        checksum their owner published."""
        if not self._expected(ns_id):
            raise InvalidArgument("namespace_id", "unknown to this client; call register_namespace first")
        sinks = [KeepPayload(self._expected(ns_id)) for _ in hashes]
        sizes = self._get_sinks(ns_id, hashes, sinks)
        return [None if n is None else (s.codec, s.payload) for s, n in zip(sinks, sizes)]

    def _get_sinks(self, ns_id: bytes, hashes: Sequence[bytes], sinks: list,
                   byte_range: tuple[int, int] | None = None) -> list[int | None]:
        self._negotiation.ensure()
        sizes: list[int | None] = []
        for a, b in batches(len(hashes)):
            sizes += self._get_batch(ns_id, list(hashes[a:b]), sinks[a:b], byte_range)
        return sizes

    def _accept(self, ns_id: bytes) -> tuple[int, ...]:
        """The codecs to take blocks as stored in: none unless we know the namespace's layout."""
        return self._negotiation.accept_codecs if bytes(ns_id) in self._layouts else ()

    def get(self, ns_id: bytes, hashes: Sequence[bytes]) -> list[bytes | None]:
        want = self._expected(ns_id)
        if not want:
            raise InvalidArgument("namespace_id", "unknown to this client; call register_namespace first")
        outs = [np.empty(want, dtype=np.uint8) for _ in hashes]
        sizes = self.get_into(ns_id, hashes, outs)
        return [None if n is None else o[:n].tobytes() for o, n in zip(outs, sizes)]

    def _get_batch(self, ns_id, hashes, sinks, byte_range=None) -> list[int | None]:
        block_bytes = self._expected(ns_id)
        accept = self._accept(ns_id) if byte_range is None else ()
        if self._negotiation.arena is not None:
            try:
                return self._shm.get(ns_id, hashes, sinks, block_bytes, accept, byte_range)
            except DaemonRestarted:
                self._negotiation.ensure()  # map the new daemon's arena (or fall back), then go on below
                if self._negotiation.arena is not None:
                    return self._shm.get(ns_id, hashes, sinks, block_bytes, accept, byte_range)
        return self._get_streamed(ns_id, hashes, sinks, byte_range)

    def _get_streamed(self, ns_id, hashes, sinks, byte_range=None) -> list[int | None]:
        """A get over the side channel when there is one, else over gRPC chunks."""
        bulk = self._negotiation.live_bulk()
        accept = self._accept(ns_id) if byte_range is None else ()
        if bulk is not None:
            return self._bulk.get(bulk, ns_id, hashes, sinks, self._expected(ns_id), accept, byte_range)
        return self._grpc.get(ns_id, hashes, sinks, self._expected(ns_id), accept, byte_range)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._shm.settle()
        self._negotiation.reset()
        self._bulk.close()
        self._closed = True
        self._rpc.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

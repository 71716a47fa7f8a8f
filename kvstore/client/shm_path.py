"""Same-host data path: copy blocks in and out of the daemon's mapped arena under leases.

A load copies out of the arena while its blocks are pinned by a lease, then ``CompleteLoad``; if
the lease had expired (a stalled client), the blocks are reported as misses because their slots
may have been reused. Blocks the daemon keeps encoded are copied out as stored when this client
decodes their codec (``accept``) and decoded only once the lease is released and confirmed. A
store stops writing and aborts when its lease is close to expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import grpc

from kvstore import errors
from kvstore.buffers import window
from kvstore.client.delivery import IntoBuffer, put_results
from kvstore.client.negotiation import Negotiation
from kvstore.client.rpc_errors import error_from_rpc
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import CAPPED_KEY, UNSTAGED_KEY

STORE_LEASE_SAFETY = 0.8   # stop copying into a store lease after this fraction of its lifetime
# a put's store leases, in blocks (the daemon's work is per block): the first small, so copying
# starts early; later ones double up to the last (fewer round trips per block)
FIRST_WINDOW_BLOCKS = 128
MAX_WINDOW_BLOCKS = 1024
# a get's load leases, in blocks, all of one size: pinning a window takes the daemon a fraction of
# the time this process takes to copy it out, so a smaller first window only adds a round trip and
# a daemon thread working beside the copy (the two share this host's cores)
LOAD_WINDOW_BLOCKS = MAX_WINDOW_BLOCKS
# a put of blocks at least this large (on average) is copied in by several threads; smaller ones
# are bound by the daemon's per-block work, which copy threads would take cores from (64 KiB
# puts were 0.33x memcpy with two threads, 0.48x with one; 256 KiB 0.81x vs 0.61x)
PARALLEL_PUT_BLOCK_BYTES = 256 << 10


def put_windows(count: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each store lease of a put of ``count`` blocks (at least one, even empty)."""
    spans, at, span = [], 0, FIRST_WINDOW_BLOCKS
    while at < count or not spans:
        spans.append((at, min(at + span, count)))
        at += span
        span = min(2 * span, MAX_WINDOW_BLOCKS)
    return spans


class _Completion(NamedTuple):
    """A CompleteStore in flight, and its request (asked again if the daemon was unreachable)."""
    future: object
    request: object


class _Extent(NamedTuple):
    """An extent of a lease's table, as ``ArenaMap.ensure`` / ``SegmentMap.ensure`` read it."""
    offset: int
    length: int
    generation: int


class _Slots(NamedTuple):
    """One block of a lease: its (offset, length) pieces, stored bytes, codec, already present."""
    extents: list[tuple[int, int]]
    size: int
    codec: int
    present: bool


def lease_slots(lease) -> tuple[list[_Slots], Iterator[_Extent]]:
    """Each block of a ``pb.LeaseResponse``, and every extent it names (made as they are read: a
    whole mapped arena reads none), from its ``table`` (parallel arrays, read a field at a time)."""
    t = lease.table
    counts, offsets, lengths, sizes = list(t.extent_counts), list(t.offsets), list(t.lengths), list(t.sizes)
    n = len(counts)
    codecs = list(t.codecs) or [0] * n
    present = list(t.present) or [False] * n
    if not (len(sizes) == len(codecs) == len(present) == n and sum(counts) == len(offsets) == len(lengths)):
        raise errors.DaemonUnavailable("shared memory: the daemon's lease table is inconsistent")
    pieces = list(zip(offsets, lengths))
    if counts.count(1) == n:   # one extent each (the usual case): no slicing
        blocks = [_Slots([p], s, c, pr) for p, s, c, pr in zip(pieces, sizes, codecs, present)]
    else:
        blocks, at = [], 0
        for k in range(n):
            c = counts[k]
            blocks.append(_Slots(pieces[at:at + c], sizes[k], codecs[k], present[k]))
            at += c
    return blocks, _table_extents(t, offsets, lengths)


def _table_extents(table, offsets: list[int], lengths: list[int]) -> Iterator[_Extent]:
    """Every extent a lease's ``table`` names, made as they are read (a whole mapped arena reads none)."""
    generations = list(table.generations) or [0] * len(offsets)
    return (_Extent(o, ln, g) for o, ln, g in zip(offsets, lengths, generations))


def _direct_copies(lease, sinks, start: int):
    """``(offsets, lengths, destinations, extents)`` when every block of a load lease is one raw
    extent that lands straight in its caller's host buffer (the usual get: small blocks are bound
    by per-block Python, and this is the least of it), else None and the caller takes the general
    path. Read from the lease's ``table``."""
    t = lease.table
    counts = list(t.extent_counts)
    n = len(counts)
    if not n or len(t.codecs) or counts.count(1) != n or start + n > len(sinks):
        return None
    offsets, lengths, sizes = list(t.offsets), list(t.lengths), list(t.sizes)
    if not (len(offsets) == len(lengths) == len(sizes) == n) or sizes != lengths:
        return None
    dsts = []
    for sink, size in zip(sinks[start:start + n], sizes):
        dst = sink.raw_destination(size) if isinstance(sink, IntoBuffer) else None
        if dst is None:
            return None
        dsts.append(dst)
    return offsets, lengths, dsts, _table_extents(t, offsets, lengths)


def _direct_fills(lease, arrays):
    """``(offsets, extents)`` when every block of a store lease is to be written (none present)
    and each fits the one extent it has (the usual put), else None and the caller takes the
    general path: no per-block objects, as ``_direct_copies`` for a get. Read from the lease's
    ``table``."""
    t = lease.table
    counts = list(t.extent_counts)
    n = len(counts)
    if not n or n != len(arrays) or any(t.present) or counts.count(1) != n:
        return None
    offsets, lengths = list(t.offsets), list(t.lengths)
    if not (len(offsets) == len(lengths) == n) or min(lengths) < max(a.nbytes for a in arrays):
        return None
    return offsets, _table_extents(t, offsets, lengths)


class ShmPath:
    """Puts and gets through the mapped arena. ``stream_one`` fetches blocks the arena could not
    stage (present, but no free unpinned slot) over a streaming path instead of missing them;
    ``stream_put`` stores blocks the arena has no unpinned room for the same way."""

    def __init__(self, negotiation: Negotiation, stream_one: Callable, stream_put: Callable) -> None:
        self.negotiation = negotiation
        self.rpc = negotiation.rpc
        self.leases = negotiation.leases   # lease RPCs: the daemon's Unix socket, else gRPC
        self.stream_one = stream_one
        self.stream_put = stream_put
        self._pending: list = []   # background CompleteLoad calls

    def put(self, ns_id: bytes, hashes, arrays, parent: bytes | None, block_bytes: int, codec: int = 0) -> list[str]:
        """``codec``: ``arrays`` are payloads this client encoded (a block long: raw); each is
        written at the start of its block's slots and CompleteStore names their sizes.

        One store lease per window of blocks (``put_windows``; a put of at most
        ``FIRST_WINDOW_BLOCKS`` is one lease): window k+1's lease is asked for before
        window k is copied, and window k is completed while k+1 is copied, completions in order
        (a chain is published parent first). The daemon's per-block work, reserving slots and
        then indexing and publishing the blocks, thus runs while this process copies instead of
        before and after. An arena full of pinned blocks (``TierFull``) sends the blocks not yet
        stored to ``stream_put``; any other failure raises, the windows completed before it stay."""
        spans = put_windows(len(hashes))
        results: list[str] = []

        def prepare(a: int, b: int):
            return self.negotiation.start_same_daemon("PrepareStore", pb.PrepareStoreRequest(
                namespace_id=ns_id, hashes=hashes[a:b], parent=(hashes[a - 1] if a else parent) or b"",
                block_bytes=block_bytes), wait=len(spans) == 1)

        ahead, filled, completing = prepare(*spans[0]), None, None
        try:
            for k, (a, b) in enumerate(spans):
                call, ahead = ahead, None
                lease, _ = call.result()
                last = k + 1 == len(spans)
                if not last:
                    ahead = prepare(*spans[k + 1])
                self._fill(lease, call.sent, arrays[a:b])
                filled = lease
                if completing is not None:
                    results += self._completed(completing)
                completing, filled = self._complete(lease, codec, arrays[a:b], wait=last), None
            results += self._completed(completing)
            completing = None
        except errors.TierFull:
            self._unwind(ahead, filled, completing, results)
            rest = len(results)
            return results + self.stream_put(ns_id, hashes[rest:], arrays[rest:],
                                             hashes[rest - 1] if rest else parent, block_bytes, codec)
        except BaseException:
            self._unwind(ahead, filled, completing, results)
            raise
        return results

    def _fill(self, lease, sent: float, arrays) -> None:
        """Copy each block not yet present into its slots; the lease is aborted if that fails
        (or runs out: the daemon may reuse the slots of an expired store lease)."""
        safe_until = sent + STORE_LEASE_SAFETY * lease.expires_in

        def in_time() -> None:
            if time.monotonic() > safe_until:
                raise errors.LeaseExpired("lease_id: the store lease ran out while copying; aborted")

        try:
            arena = self.negotiation.arena
            direct = _direct_fills(lease, arrays)
            if direct is not None:   # every block one extent it fits: straight from the caller's arrays
                offsets, pieces = direct
                self._map(arena, pieces)
                large = sum(a.nbytes for a in arrays) >= PARALLEL_PUT_BLOCK_BYTES * len(arrays)
                arena.copy_each_in(offsets, arrays, in_time, threads=None if large else 1)
                return
            blocks, pieces = lease_slots(lease)
            self._map(arena, pieces)
            offsets, srcs = [], []   # blocks whose bytes fit their first extent: copied in one run
            for blk, src in zip(blocks, arrays):
                if blk.present:
                    continue
                if blk.extents and blk.extents[0][1] >= src.nbytes:
                    offsets.append(blk.extents[0][0])
                    srcs.append(src)
                    continue
                in_time()
                arena.copy_in(window(blk.extents, 0, src.nbytes), src)
            large = sum(s.nbytes for s in srcs) >= PARALLEL_PUT_BLOCK_BYTES * len(srcs)
            arena.copy_each_in(offsets, srcs, in_time, threads=None if large else 1)
        except BaseException:
            self._abort(lease)
            raise

    def _complete(self, lease, codec: int, arrays, wait: bool) -> _Completion:
        """CompleteStore started (``wait``: made at once: the last window's, nothing overlaps it)."""
        request = pb.LeaseRequest(lease_id=lease.lease_id, codec=codec, sizes=[a.nbytes for a in arrays] if codec else [])
        return _Completion(self.leases.start("CompleteStore", request, wait), request)

    def _completed(self, completion: _Completion) -> list[str]:
        """A CompleteStore's results; one that found the daemon unreachable is asked again (with
        retries): a completion the daemon did make answers ``LeaseExpired`` the second time."""
        try:
            return put_results(completion.future.result())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise self.rpc.failed(error_from_rpc(e)) from None
        return put_results(self.leases.call("CompleteStore", completion.request)[0])

    def _unwind(self, ahead, filled, completing, results: list[str]) -> None:
        """After a failure: a completion in flight is waited for (its blocks are stored, and
        counted in ``results``), a filled lease not yet completed and a prepared one are aborted."""
        if completing is not None:
            try:
                results += self._completed(completing)
            except KVStoreError:
                pass
        if filled is not None:
            self._abort(filled)
        if ahead is not None:
            try:
                lease, _ = ahead.result()
            except KVStoreError:
                return   # never leased (or leased by another daemon run, which released it)
            self._abort(lease)

    def _abort(self, lease) -> None:
        try:
            self.leases.call("AbortStore", pb.LeaseRequest(lease_id=lease.lease_id))
        except KVStoreError:
            pass  # the lease expires on its own

    def get(self, ns_id: bytes, hashes, sinks, block_bytes: int, accept=(),
            byte_range: tuple[int, int] | None = None) -> list[int | None]:
        """Each block into its sink (``delivery``); its size, or None for a miss. ``byte_range``:
        only those bytes of each (raw) block are copied out (``accept`` must then be empty).

        One load lease per window of ``LOAD_WINDOW_BLOCKS``: window k+1's lease is asked for
        before window k is copied, so the daemon pins and describes the next blocks while this
        process copies. A lease cut short at the tenant's lease budget (the daemon says so) is
        asked for again from where it stopped, once this get's earlier lease is released. Any
        other lease stops at the first block it cannot lease: that one is fetched over a stream
        when the daemon says it is present but could not be staged, else it is a miss; the next
        window starts after it (a lease asked for ahead from elsewhere is released unused)."""
        sizes: list[int | None] = [None] * len(hashes)
        start, span = 0, LOAD_WINDOW_BLOCKS
        ahead = None   # (start, stop, call): the next window's PrepareLoad, in flight while this one is copied

        def prepare(a: int, b: int):
            return a, b, self.negotiation.start_same_daemon("PrepareLoad", pb.PrepareLoadRequest(
                namespace_id=ns_id, hashes=hashes[a:b], block_bytes=block_bytes, accept_codecs=accept))

        try:
            while start < len(hashes):
                fresh = ahead is None or ahead[0] != start   # asked with none of our pins held
                if fresh:
                    self._drop(ahead)
                    self.settle()  # our previous pins are released before we pin more (small arenas)
                    ahead = prepare(start, min(len(hashes), start + span))
                (_, asked, call), ahead = ahead, None
                lease, meta = call.result()
                if asked < len(hashes):
                    ahead = prepare(asked, min(len(hashes), asked + span))
                got = []
                count = 0
                try:
                    arena = self.negotiation.arena
                    direct = _direct_copies(lease, sinks, start) if byte_range is None else None
                    if direct is not None:   # every block one raw extent, straight into the caller's buffer
                        offsets, lengths, dsts, pieces = direct
                        self._map(arena, pieces)
                        arena.copy_each_out(offsets, lengths, dsts)
                        count = len(dsts)
                    else:
                        blocks, pieces = lease_slots(lease)
                        self._map(arena, pieces)
                        for i, blk in enumerate(blocks, start):
                            extents, size = blk.extents, blk.size
                            if byte_range is not None:
                                extents, size = window(extents, *byte_range), byte_range[1]
                            arena.copy_out(extents, sinks[i].buffer(size))
                            got.append((i, size, blk.codec))
                        count = len(blocks)
                finally:
                    confirmed = self._release(lease, call.sent)
                if confirmed:
                    if direct is not None:
                        sizes[start:start + count] = lengths   # raw and in place: nothing left to finish
                    for i, size, codec in got:
                        sizes[i] = sinks[i].finish(size, codec)
                stop = start + count
                if stop == asked:   # the whole window leased: the next one goes on from here
                    start = stop
                    continue
                if meta.get(CAPPED_KEY) and not (fresh and count == 0):
                    # cut short at our tenant's lease budget, which our earlier window still held
                    # part of: asked again from here once that is released (progress: a fresh
                    # lease that gets nothing falls through to the stream below)
                    start = stop
                    continue
                if meta.get(UNSTAGED_KEY) and stop < len(hashes):
                    sizes[stop] = self.stream_one(ns_id, [hashes[stop]], [sinks[stop]], byte_range)[0]
                start = stop + 1  # skip past the first miss
        finally:
            self._drop(ahead)
        return sizes

    def _drop(self, ahead) -> None:
        """Release a window's load lease asked for ahead and not used (the window before it missed)."""
        if ahead is None:
            return
        try:
            lease, _ = ahead[2].result()
        except KVStoreError:
            return
        self._release(lease, ahead[2].sent)

    @staticmethod
    def _map(arena, extents) -> None:
        """Tenant segments a lease names that this process has not mapped yet (or mapped at
        another generation) are fetched first; failing to, the call fails like a lost daemon."""
        try:
            arena.ensure(extents)
        except OSError as e:
            raise errors.DaemonUnavailable(f"shared memory: cannot map the lease's segments ({e})") from None

    def _release(self, lease, t0: float) -> bool:
        """Release a load lease; True when the copies made under it are trustworthy.

        The daemon started the lease after ``t0``, so a copy that ended before ``t0 + expires_in``
        ran entirely under the pins: release them without waiting for the answer (one round trip
        less per get). A slower copy is trusted only if the daemon confirms."""
        if time.monotonic() < t0 + lease.expires_in:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self.leases.start("CompleteLoad", pb.LeaseRequest(lease_id=lease.lease_id)))
            return True
        try:
            self.leases.call("CompleteLoad", pb.LeaseRequest(lease_id=lease.lease_id))
            return True
        except errors.LeaseExpired:
            return False  # slots may have been reused while we copied: report misses

    def settle(self) -> None:
        """Wait for background releases, so what this client observes next includes them.
        A lost release only means the pins last until the lease ends."""
        for f in self._pending:
            try:
                f.result()
            except (grpc.RpcError, KVStoreError):
                pass
        self._pending = []

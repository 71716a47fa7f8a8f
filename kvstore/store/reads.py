"""Reading one block by value: its fastest copy into the caller's buffer, as stored or decoded.

A reader names the codecs it decodes itself (``accept``): a copy encoded with one of them is
handed over as stored (smaller; the caller learns the codec id), any other is decoded here. A
copy that fails its checksum or its decode is dropped (counted) and the next copy tried; a hit
on a slower tier is promoted, from the payload just read (no second read or decode). A payload
decoded here is read in place when it is one piece of the CPU arena (the pin holds it), else into
a buffer of this module's, never the cascade's scratch, which a promotion's demotions reuse.

Several blocks whose fastest copies sit below the CPU tier (NVMe, Redis) are read a few at a
time (``read_blocks``): each read waits on the disk or the network with the GIL released, so
their waits overlap instead of adding up. On a tier that keeps neighbouring blocks side by side
(``Tier.reads_in_runs``: NVMe slabs) each of those reads is a run of up to ``RUN_BYTES`` of
blocks, read with one call (``Tier.read_many_into``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.errors import BlockCorrupt, CodecError
from kvstore.store.cascade import Cascade
from kvstore.store.io_pools import LazyPool
from kvstore.threads import BUDGET

# Not the cascade's scratch: a read payload must outlive the promotion it feeds, which can demote
# another block through the cascade's buffer.
_payloads = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)   # one per thread

READS_IN_FLIGHT = BUDGET.slow_reads   # slow-tier reads of one call at once (queue depth for NVMe)
RUN_BYTES = 1 << 20   # blocks handed to one of those reads together (tiers that read runs)
_readers = LazyPool(READS_IN_FLIGHT, "kvstore-slow-read")


# a fresh buffer per read: a payload read on a pool thread must outlive that thread's next read
_own_payloads = Scratch(trim_above=0, aligned=True)


def read_blocks(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], dsts: Sequence[np.ndarray],
                accept: Collection[int] = ()) -> list[tuple[int, int] | None]:
    """``read_block`` for each hash, in order. Blocks found below the CPU tier are read up to
    ``READS_IN_FLIGHT`` at once when there are several; hits are still counted and promoted in
    the callers' order (prefix-aware eviction keeps a promoted prefix together)."""
    slow_from = cascade.cpu_index + 1 if cascade.cpu_index is not None else 0
    resident = _read_resident(cascade, namespace_id, hashes, dsts, accept, slow_from)
    if resident is not None:
        return resident
    with cascade.lock:
        slow = [i for i, h in enumerate(hashes)
                if (e := cascade.index.visible(namespace_id, h)) is not None and e.fastest >= slow_from]
    if len(slow) < 2:
        return [read_block(cascade, namespace_id, h, dst, accept) for h, dst in zip(hashes, dsts)]
    pool = _readers.get()
    per_run = max(1, RUN_BYTES // max(1, max(dsts[i].nbytes for i in slow)))
    chunks = [slow[k:k + per_run] for k in range(0, len(slow), per_run)]
    reads = {}   # block index -> the read of the chunk holding it
    for chunk in chunks:
        f = pool.submit(_read_chunk, cascade, namespace_id, hashes, dsts, accept, chunk)
        reads.update((i, f) for i in chunk)
    taken: dict[int, _Read | None] = {}
    out = []
    try:
        for i, h in enumerate(hashes):
            if i in reads:
                if i not in taken:
                    taken.update(reads[i].result())
                got = taken.pop(i)
                del reads[i]
            else:
                got = _read_fastest(cascade, namespace_id, h, dsts[i], accept, _payloads)
            out.append(None if got is None else _deliver(cascade, got))
    except BaseException:
        # reads done or still in flight keep their pins until delivered: release them
        for f in {id(f): f for f in reads.values()}.values():
            if f.exception() is None:
                taken.update(f.result())
        with cascade.lock:
            for i, got in taken.items():
                if got is not None and i in reads:
                    cascade.unpin(got.entry)
        raise
    return out


def _read_chunk(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], dsts: Sequence[np.ndarray],
                accept: Collection[int], chunk: Sequence[int]) -> dict[int, _Read | None]:
    """``_read_fastest`` for the blocks ``chunk`` (on a pool thread): those whose fastest copy is
    on a tier that reads runs, as stored, are pinned together and read with one
    ``read_many_into``; a copy that fails its check is dropped and its block read again alone
    (the next copy, or a miss), as is every other block of the chunk."""
    tiers = cascade.tiers
    together: list[tuple[int, object, int, int]] = []   # (block index, entry, tier, codec)
    alone: list[int] = []
    with cascade.lock:
        for i in chunk:
            entry = cascade.pin(namespace_id, hashes[i])
            if entry is None:
                alone.append(i)   # _read_fastest counts the miss
                continue
            t = entry.fastest
            codec = entry.copies[t].codec
            if tiers[t].reads_in_runs and (codec == 0 or codec in accept) and (not together or together[0][2] == t):
                together.append((i, entry, t, codec))
            else:
                cascade.unpin(entry)
                alone.append(i)
    out: dict[int, _Read | None] = {}
    if together:
        t = together[0][2]
        try:
            sizes = tiers[t].read_many_into([e.key for _, e, _, _ in together], [dsts[i] for i, _, _, _ in together])
        except BaseException:
            with cascade.lock:
                for _, entry, _, _ in together:
                    cascade.unpin(entry)
            raise
        for (i, entry, t, codec), n in zip(together, sizes):
            if isinstance(n, Exception):
                with cascade.lock:
                    if isinstance(n, BlockCorrupt):
                        cascade.discard_corrupt_copy(entry, t)
                    cascade.unpin(entry)
                alone.append(i)
            else:
                out[i] = _Read(entry, t, n, codec, dsts[i][:n], None)
    try:
        for i in alone:
            out[i] = _read_fastest(cascade, namespace_id, hashes[i], dsts[i], accept, _own_payloads)
    except BaseException:
        with cascade.lock:   # nothing of this chunk is delivered: none stays pinned
            for got in out.values():
                if got is not None:
                    cascade.unpin(got.entry)
        raise
    return out


#: where a staging run's copies land, one kept buffer per calling thread: touched once and reused,
#: so reading into it takes no page faults (a fresh buffer per read cost a fault per page)
_staging = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True)


def read_copies(cascade: Cascade, copies: Sequence[tuple[object, int]], sizes: Sequence[int]) -> list:
    """The bytes of each ``(entry, tier)`` copy (``sizes``: their stored bytes, read under the lock
    by the caller), the caller holding a pin on each entry and not the store lock: read up to
    ``READS_IN_FLIGHT`` at once, each into its own page-aligned part of this thread's staging
    buffer (valid until this thread's next call). In place of a read that failed, its exception
    (``BlockCorrupt`` for a damaged copy)."""
    spans = [-(-n // 4096) * 4096 for n in sizes]   # page-aligned parts: O_DIRECT reads land in place
    buf = _staging.get(sum(spans))
    dsts, at = [], 0
    for span in spans:
        dsts.append(buf[at:at + span])
        at += span

    def run(t, ks):   # one read_many_into: neighbours on a tier that reads runs, else one copy
        sizes = cascade.tiers[t].read_many_into([copies[k][0].key for k in ks], [dsts[k] for k in ks])
        return [n if isinstance(n, Exception) else dsts[k][:n] for k, n in zip(ks, sizes)]

    if len(copies) == 1:   # on this thread: no pool hop for one read
        try:
            return run(copies[0][1], [0])
        except Exception as e:  # noqa: BLE001 - handed back in its place
            return [e]
    pool = _readers.get()
    reads: list[tuple[list[int], object]] = []   # (copy indices, the read of them)
    k = 0
    while k < len(copies):
        t = copies[k][1]
        ks, nbytes = [k], spans[k]
        while (cascade.tiers[t].reads_in_runs and k + len(ks) < len(copies) and copies[k + len(ks)][1] == t
               and nbytes + spans[k + len(ks)] <= RUN_BYTES):
            nbytes += spans[k + len(ks)]
            ks.append(k + len(ks))
        reads.append((ks, pool.submit(run, t, ks)))
        k += len(ks)
    out: list = [None] * len(copies)
    for ks, f in reads:   # a read that raised stands in for each of its copies
        for j, got in zip(ks, f.result() if f.exception() is None else [f.exception()] * len(ks)):
            out[j] = got
    return out


def _read_resident(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], dsts: Sequence[np.ndarray],
                   accept: Collection[int], slow_from: int) -> list[tuple[int, int] | None] | None:
    """The common batch, with two lock acquisitions instead of three per block: every block
    absent, or with its fastest copy in RAM (a tier before ``slow_from``) in a form the reader
    takes as it is (raw, or a codec in ``accept``). All are pinned at once, copied outside the
    lock, then counted, touched, promoted and unpinned in the callers' order at once, as
    ``_deliver`` does one by one. None (nothing pinned) when some block needs the per-block path:
    a slower tier's read, or a decode. A copy that fails its check is dropped and its block read
    again through ``read_block`` (the next copy, or a miss)."""
    entries = cascade.index.entries
    with cascade.lock:
        plan: list[tuple[object, int] | None] = []
        for h in hashes:
            entry = entries.get(namespace_id + h)
            if entry is None or not entry.visible:
                plan.append(None)
                continue
            t = entry.fastest
            codec = entry.copies[t].codec
            if t >= slow_from or (codec != 0 and codec not in accept):
                return None
            plan.append((entry, t, codec))
        misses = 0
        for p in plan:
            if p is None:
                misses += 1
            else:
                cascade.pin_entry(p[0])
        if misses:
            cascade.count("misses", misses)
    out: list[tuple[int, int] | None] = [None] * len(hashes)
    sizes = [0] * len(hashes)
    retry: set[int] = set()
    tiers = cascade.tiers
    try:
        for i, p in enumerate(plan):
            if p is None:
                continue
            entry, t, _ = p
            try:
                sizes[i] = tiers[t].read_into(entry.key, dsts[i])
            except (BlockCorrupt, CodecError):
                with cascade.lock:
                    cascade.discard_corrupt_copy(entry, t)
                    cascade.unpin(entry)
                retry.add(i)
    except BaseException:
        with cascade.lock:   # nothing is delivered yet: every block stays stored, none pinned for good
            for k, p in enumerate(plan):
                if p is not None and k not in retry:
                    cascade.unpin(p[0])
        raise
    start = 0
    for k in sorted(retry) + [len(plan)]:
        _deliver_run(cascade, plan, sizes, dsts, accept, start, k, out)
        if k < len(plan):
            out[k] = read_block(cascade, namespace_id, hashes[k], dsts[k], accept)
        start = k + 1
    return out


def _deliver_run(cascade: Cascade, plan, sizes, dsts, accept, start: int, stop: int, out: list) -> None:
    """``_deliver`` for the pinned reads ``plan[start:stop]`` under one lock acquisition."""
    if start >= stop:
        return
    policies, tiers = cascade.index.policies, cascade.tiers
    promote = cascade.config.promote_on_hit
    hits = [0] * len(tiers)
    nbytes = 0
    with cascade.lock:
        for i in range(start, stop):
            p = plan[i]
            if p is None:
                continue
            entry, t, codec = p
            n = sizes[i]
            hits[t] += 1
            nbytes += n
            policies[t].touch(entry.key)
            if t > 0 and promote and not entry.doomed:
                cascade.promote(entry, t, dsts[i][:n], None)
            cascade.unpin(entry)
            out[i] = (n, codec)
        for t, k in enumerate(hits):   # counted once per run: the same totals, under the same lock
            if k:
                cascade.count(f"hits_{tiers[t].name}", k)
        if any(hits):
            cascade.count("bytes_out", nbytes)


def read_block(cascade: Cascade, namespace_id: bytes, block_hash: bytes, dst: np.ndarray,
               accept: Collection[int] = ()) -> tuple[int, int] | None:
    """Copy one block's fastest copy into ``dst`` (at least a block long): ``(bytes, codec id)``,
    or None for a miss."""
    got = _read_fastest(cascade, namespace_id, block_hash, dst, accept, _payloads)
    return None if got is None else _deliver(cascade, got)


class _Read:
    """One copy read into the caller's buffer, its entry still pinned until ``_deliver``."""
    __slots__ = ("entry", "tier", "n", "codec", "payload", "decoded")

    def __init__(self, entry, tier: int, n: int, codec: int, payload, decoded) -> None:
        self.entry, self.tier, self.n, self.codec, self.payload, self.decoded = entry, tier, n, codec, payload, decoded


def _read_fastest(cascade: Cascade, namespace_id: bytes, block_hash: bytes, dst: np.ndarray,
                  accept: Collection[int], payloads: Scratch) -> _Read | None:
    while True:
        with cascade.lock:
            entry = cascade.pin(namespace_id, block_hash)
            if entry is None:
                cascade.count("misses")
                return None
            t = entry.fastest
        record = entry.copies[t]
        tier = cascade.tiers[t]
        decoded = None
        try:
            codec = record.codec
            if codec != 0 and codec not in accept:
                payload = cascade.read_copy(entry, t, payloads)
                decoded = cascade.transcoder.decode(namespace_id, entry.raw_size, record, payload, out=dst)
                n, codec = decoded.nbytes, 0
            else:
                n = tier.read_into(entry.key, dst)
                payload = dst[:n]
        except (BlockCorrupt, CodecError):
            with cascade.lock:
                cascade.discard_corrupt_copy(entry, t)
                cascade.unpin(entry)
            continue  # try the next copy, or report a miss
        except BaseException:
            with cascade.lock:   # any other failure: the block stays stored, but not pinned for good
                cascade.unpin(entry)
            raise
        return _Read(entry, t, n, codec, payload, decoded)


def _deliver(cascade: Cascade, got: _Read) -> tuple[int, int]:
    """Count the hit, promote a slower tier's copy from the payload just read, unpin."""
    entry, t = got.entry, got.tier
    promote = (t > 0 and cascade.config.promote_on_hit and not entry.doomed   # its I/O outside the lock
               and cascade.prepare_promotion(entry, t, got.payload, got.decoded))
    with cascade.lock:
        cascade.count(f"hits_{cascade.tiers[t].name}")
        cascade.count("bytes_out", got.n)
        cascade.index.policies[t].touch(entry.key)
        if promote and not entry.doomed:
            cascade.promote(entry, t, got.payload, got.decoded)
        cascade.unpin(entry)
    return got.n, got.codec

"""Reading blocks by value: each block's fastest copy into the caller's buffer, as stored or decoded.

One path for every read, in three steps, as the cascade's books want them:

1. ``_plan`` (under the lock, no I/O): pin each present block's fastest copy; count the misses.
2. ``_execute`` (lock released): read each copy into the caller's buffer; a copy encoded with a
   codec the reader does not decode itself (``accept``) is read and decoded here. Copies below the
   CPU tier (NVMe, Redis) are read a few at a time when there are several: each read waits on the
   disk or the network with the GIL released, so their waits overlap instead of adding up; on a
   tier that keeps neighbouring blocks side by side (``Tier.reads_in_runs``: NVMe slabs) each of
   those reads is a run of up to ``RUN_BYTES`` of blocks, read with one call.
3. ``_complete`` (under the lock, once per batch): in the callers' order, count each hit, touch its
   policy, promote a slower tier's copy from the payload just read (no second read or decode; the
   room for it was made before, with the lock released); then unpin them. A copy that failed its
   checksum or its decode is dropped (counted) and its block planned again: the next copy, or a miss.

A payload decoded here is read in place when it is one piece of the CPU arena (the pin holds it),
else into a buffer of its own, never the cascade's scratch, which a promotion's demotions reuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.errors import BlockCorrupt, CodecError
from kvstore.store.index import Entry
from kvstore.threads import BUDGET, LazyPool

if TYPE_CHECKING:
    from kvstore.store.cascade import Cascade

READS_IN_FLIGHT = BUDGET.slow_reads   # slow-tier reads of one call at once (queue depth for NVMe)
RUN_BYTES = 1 << 20   # blocks handed to one of those reads together (tiers that read runs)
_readers = LazyPool(READS_IN_FLIGHT, "kvstore-slow-read")

# a fresh buffer per decoded read: its payload must outlive this thread's next read (a promotion
# copies from it after the batch is read)
_own_payloads = Scratch(trim_above=0, aligned=True)


@dataclasses.dataclass(slots=True)
class BlockRead:
    """One pinned copy of a batch, on its way into the caller's buffer ``at``."""

    at: int            # position in the call
    entry: Entry       # pinned until ``_complete``
    tier: int          # where its copy is read from
    codec: int         # the copy's codec; 0 once decoded here
    decode: bool       # encoded with a codec the reader does not take: decoded here
    n: int = 0                 # bytes delivered
    payload: object = None     # the copy's stored bytes (what a promotion copies)
    decoded: object = None     # its raw bytes, when decoded here
    failed: Exception | None = None   # BlockCorrupt / CodecError: dropped, planned again
    promote: bool = False      # copied up into a memory tier under the lock (``Cascade.promote``)


def read_blocks(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], dsts: Sequence[np.ndarray],
                accept: Collection[int] = ()) -> list[tuple[int, int] | None]:
    """Copy each block's fastest copy into ``dsts[i]`` (at least a block long): per block
    ``(bytes, codec id)`` (codec 0: the block itself), or None for a miss."""
    out: list[tuple[int, int] | None] = [None] * len(hashes)
    todo = range(len(hashes))
    while todo:
        reads = _plan(cascade, namespace_id, hashes, todo, accept)
        try:
            _execute(cascade, reads, dsts)
        except BaseException:
            with cascade.lock:   # nothing is delivered: every block stays stored, none pinned for good
                for r in reads:
                    cascade.unpin(r.entry)
            raise
        up = [r for r in reads if r.tier > 0 and r.failed is None and not r.entry.doomed] \
            if cascade.config.promote_on_hit else []
        if any(r.tier >= slow_from(cascade) for r in up):
            # hits below the CPU tier are promoted one by one, in the callers' order, each after
            # the room it needs is made (victims written down, lock released): the next block's
            # room is then chosen knowing where this one went, as prefix-aware eviction wants
            todo = []
            for r in reads:
                if r in up:
                    r.promote = cascade.prepare_promotions([(r.entry, r.tier, r.payload, r.decoded)])[0]
                todo += _complete(cascade, [r], out)
        else:   # in RAM already: promoted (GPU) under the one lock acquisition
            for r in up:
                r.promote = True
            todo = _complete(cascade, reads, out)
    return out


def slow_from(cascade: Cascade) -> int:
    """The first tier whose reads wait on a disk or a network: the one below the CPU tier."""
    return cascade.cpu_index + 1 if cascade.cpu_index is not None else 0


def _plan(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], todo: Sequence[int],
          accept: Collection[int]) -> list[BlockRead]:
    """Pin the fastest copy of each present block of ``todo`` and count the rest as misses (lock held here)."""
    entries = cascade.index.entries
    reads, misses = [], 0
    with cascade.lock:
        for i in todo:
            entry = entries.get(namespace_id + hashes[i])   # index.visible, inlined: hot
            if entry is None or not entry.visible:
                misses += 1
                continue
            t, codec = entry.copies.first_codec()
            reads.append(BlockRead(i, entry, t, codec, codec != 0 and codec not in accept))
        cascade.pin_all([r.entry for r in reads])
        if misses:
            cascade.count("misses", misses)
    return reads


def _execute(cascade: Cascade, reads: list[BlockRead], dsts: Sequence[np.ndarray]) -> None:
    """Read every planned copy into its buffer, the lock released: below the CPU tier several at
    once (runs where the tier reads runs), the rest on this thread. A damaged copy sets ``failed``;
    any other failure raises (the caller unpins)."""
    slow_tiers = slow_from(cascade)
    slow = [r for r in reads if r.tier >= slow_tiers and not r.decode]
    if len(slow) < 2:
        slow = []
    in_flight = []
    if slow:
        pool = _readers.get()
        for ks in _runs(cascade, [r.tier for r in slow], [dsts[r.at].nbytes for r in slow]):
            in_flight.append(pool.submit(_read_run, cascade, [slow[k] for k in ks], dsts))
    taken = {id(r) for r in slow} if slow else ()
    try:
        run: list[BlockRead] = []   # neighbours in the call of one tier, none to decode: one read_many_into
        for r in reads:
            if taken and id(r) in taken:
                continue
            if run and (r.decode or r.tier != run[0].tier):
                _read_run(cascade, run, dsts)
                run = []
            if r.decode:
                _read_run(cascade, [r], dsts)
            else:
                run.append(r)
        if run:
            _read_run(cascade, run, dsts)
    finally:
        errors = [f.exception() for f in in_flight]   # waits for every read: none may outlive the pins
    for e in errors:
        if e is not None:
            raise e


def _runs(cascade: Cascade, tiers: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Positions ``0..len(tiers)-1`` cut into the runs read with one call each: neighbours on one
    tier that reads runs (``Tier.reads_in_runs``), up to ``RUN_BYTES`` of ``sizes`` together;
    one position each on any other tier."""
    k = 0
    while k < len(tiers):
        run, nbytes = [k], sizes[k]
        while (cascade.tiers[tiers[k]].reads_in_runs and k + len(run) < len(tiers)
               and tiers[k + len(run)] == tiers[k] and nbytes + sizes[k + len(run)] <= RUN_BYTES):
            nbytes += sizes[k + len(run)]
            run.append(k + len(run))
        yield run
        k += len(run)


def _read_run(cascade: Cascade, run: list[BlockRead], dsts: Sequence[np.ndarray]) -> None:
    """Read ``run`` (copies of one tier, none to decode when more than one) into their buffers;
    ``payload`` is kept only for copies below the first tier (what a promotion copies)."""
    tier = cascade.tiers[run[0].tier]
    if len(run) == 1 and run[0].decode:
        r = run[0]
        record = r.entry.copies[r.tier]
        try:
            r.payload = cascade.read_copy(r.entry, r.tier, _own_payloads)
            r.decoded = cascade.transcoder.decode(r.entry.namespace_id, r.entry.raw_size, record, r.payload,
                                                  out=dsts[r.at])
            r.n, r.codec = r.decoded.nbytes, 0
        except (BlockCorrupt, CodecError) as e:
            r.failed = e
        return
    if len(run) == 1:
        r = run[0]
        try:
            r.n = tier.read_into(r.entry.key, dsts[r.at])
            r.payload = dsts[r.at][:r.n]
        except BlockCorrupt as e:
            r.failed = e
        return
    sizes = tier.read_many_into([r.entry.key for r in run], [dsts[r.at] for r in run])
    below = run[0].tier > 0
    for r, n in zip(run, sizes):
        if type(n) is int:
            r.n = n
            if below:
                r.payload = dsts[r.at][:n]
        elif isinstance(n, BlockCorrupt):
            r.failed = n
        else:
            raise n


def _complete(cascade: Cascade, reads: list[BlockRead], out: list) -> list[int]:
    """Under one lock acquisition, in the callers' order: count, touch and promote each read
    (``out[at]``: its size and codec), then unpin them all (a block read stays pinned while the
    batch's promotions make room); drop each damaged copy (counted) and unpin its block. The
    touches go to each policy a run at a time (``touch_many``), in the same order. Returns the
    positions to plan again (their next copy, or a miss)."""
    again: list[int] = []
    policies, tiers = cascade.index.policies, cascade.tiers
    hits, nbytes = [0] * len(tiers), [0] * len(tiers)
    touched: list[list[bytes]] = [[] for _ in tiers]   # per tier, the keys read, in order: one touch_many each
    with cascade.lock:
        for r in reads:
            entry = r.entry
            if r.failed is not None:
                for t, keys in enumerate(touched):   # the reads before it touched first, as they came
                    if keys:
                        policies[t].touch_many(keys)
                        touched[t] = []
                if r.tier in entry.copies:
                    cascade.discard_corrupt_copy(entry, r.tier)
                cascade.unpin(entry)
                again.append(r.at)
                continue
            t = r.tier
            hits[t] += 1
            nbytes[t] += r.n
            if r.promote and not entry.doomed:   # (touched first: as it was read, before it moved)
                policies[t].touch_many(touched[t])
                touched[t] = []
                policies[t].touch(entry.key)
                cascade.promote(entry, t, r.payload, r.decoded)
            else:
                touched[t].append(entry.key)
            out[r.at] = (r.n, r.codec)
        for t, keys in enumerate(touched):
            if keys:
                policies[t].touch_many(keys)
        cascade.unpin_all([r.entry for r in reads if r.failed is None])
        for t, k in enumerate(hits):   # counted once per batch: the same totals, under the same lock
            if k:
                cascade.served(t, k, nbytes[t])
    return again


#: where staged copies land, one kept buffer per calling thread: touched once and reused, so
#: reading into it takes no page faults (a fresh buffer per read cost a fault per page)
_staging = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True)


def read_staged(cascade: Cascade, copies: Sequence[tuple[Entry, int]]) -> list:
    """The stored bytes of each pinned ``(entry, tier)`` copy, read as a get reads (``_execute``)
    into page-aligned parts of this thread's staging buffer (valid until its next call); in place
    of a copy that could not be read, the exception (``BlockCorrupt`` for a damaged one)."""
    reads = [BlockRead(k, e, t, e.copies[t].codec, False) for k, (e, t) in enumerate(copies)]
    spans = [-(-e.copies[t].stored_size // 4096) * 4096 for e, t in copies]   # O_DIRECT reads land in place
    buf, at, dsts = _staging.get(sum(spans)), 0, []
    for span in spans:
        dsts.append(buf[at:at + span])
        at += span
    try:
        _execute(cascade, reads, dsts)
    except Exception as e:  # noqa: BLE001 - a failed read stands in for each copy it left unread
        for r in reads:
            if r.payload is None and r.failed is None:
                r.failed = e
    return [r.failed if r.failed is not None else r.payload if r.payload is not None else dsts[r.at][:r.n]
            for r in reads]

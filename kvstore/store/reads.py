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
_SIZES_ONLY = {int}   # a read's results when no copy failed (each one's size)

# a fresh buffer per decoded read: its payload must outlive this thread's next read (a promotion
# copies from it after the batch is read)
_own_payloads = Scratch(trim_above=0, aligned=True)


class Round:
    """The copies one round of a get reads, pinned by ``_plan``, as parallel lists by position
    ``k`` in the round: no object per block (small blocks are bound by per-block Python).

    ``at[k]``: the block's position in the call; ``entries[k]``: pinned until ``_complete``;
    ``tiers[k]``: where its copy is read from; ``codecs[k]``: the copy's codec (0 once decoded
    here); ``n[k]``: the bytes delivered. What holds for a few positions only is kept by position:
    ``decode`` (encoded with a codec the reader does not take: decoded here), ``payloads`` (the
    copy's stored bytes, kept for copies below the first tier: what a promotion copies),
    ``decoded`` (its raw bytes, when decoded here), ``failed`` (``BlockCorrupt`` /
    ``CodecError``: dropped, planned again) and ``promote`` (copied up into a memory tier under
    the lock, ``Cascade.promote``)."""

    __slots__ = ("at", "entries", "tiers", "codecs", "n", "decode", "payloads", "decoded", "failed", "promote")

    def __init__(self, at: list[int], entries: list[Entry], tiers: list[int], codecs: list[int],
                 decode: Collection[int] = ()) -> None:
        self.at, self.entries, self.tiers, self.codecs = at, entries, tiers, codecs
        self.n = [0] * len(at)
        self.decode = set(decode)
        self.payloads: dict[int, object] = {}
        self.decoded: dict[int, object] = {}
        self.failed: dict[int, Exception] = {}
        self.promote: set[int] = set()

    def __len__(self) -> int:
        return len(self.at)


def read_blocks(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], dsts: Sequence[np.ndarray],
                accept: Collection[int] = ()) -> list[tuple[int, int] | None]:
    """Copy each block's fastest copy into ``dsts[i]`` (at least a block long): per block
    ``(bytes, codec id)`` (codec 0: the block itself), or None for a miss."""
    out: list[tuple[int, int] | None] = [None] * len(hashes)
    todo: Sequence[int] = range(len(hashes))
    while todo:
        rnd = _plan(cascade, namespace_id, hashes, todo, accept)
        try:
            _execute(cascade, rnd, dsts)
        except BaseException:
            with cascade.lock:   # nothing is delivered: every block stays stored, none pinned for good
                cascade.unpin_all(rnd.entries)
            raise
        up = [k for k, t in enumerate(rnd.tiers) if t > 0 and k not in rnd.failed and not rnd.entries[k].doomed] \
            if cascade.config.promote_on_hit and max(rnd.tiers, default=0) > 0 else []
        if any(rnd.tiers[k] >= slow_from(cascade) for k in up):
            # hits below the CPU tier are promoted one by one, in the callers' order, each after
            # the room it needs is made (victims written down, lock released): the next block's
            # room is then chosen knowing where this one went, as prefix-aware eviction wants
            todo, promoting = [], set(up)
            for k in range(len(rnd)):
                if k in promoting and cascade.prepare_promotion(rnd.entries[k], rnd.tiers[k], rnd.payloads.get(k),
                                                                rnd.decoded.get(k)):
                    rnd.promote.add(k)
                todo += _complete(cascade, rnd, out, range(k, k + 1))
        else:   # in RAM already: promoted (GPU) under the one lock acquisition
            rnd.promote.update(up)
            todo = _complete(cascade, rnd, out, range(len(rnd)))
    return out


def slow_from(cascade: Cascade) -> int:
    """The first tier whose reads wait on a disk or a network: the one below the CPU tier."""
    return cascade.cpu_index + 1 if cascade.cpu_index is not None else 0


def _plan(cascade: Cascade, namespace_id: bytes, hashes: Sequence[bytes], todo: Sequence[int],
          accept: Collection[int]) -> Round:
    """Pin the fastest copy of each present block of ``todo`` and count the rest as misses (lock held here)."""
    with cascade.lock:
        at, pinned, tiers, codecs = cascade.pin_fastest(namespace_id, hashes, todo)
        if len(pinned) < len(todo):
            cascade.count("misses", len(todo) - len(pinned))
    decode = [k for k, c in enumerate(codecs) if c != 0 and c not in accept] if any(codecs) else ()
    return Round(at, pinned, tiers, codecs, decode)


def _execute(cascade: Cascade, rnd: Round, dsts: Sequence[np.ndarray]) -> None:
    """Read every planned copy into its buffer, the lock released: below the CPU tier several at
    once (runs where the tier reads runs), the rest on this thread. A damaged copy is set in
    ``failed``; any other failure raises (the caller unpins)."""
    tiers, decode = rnd.tiers, rnd.decode
    if not tiers:
        return
    slow_tiers = slow_from(cascade)
    if not decode and tiers[0] < slow_tiers and tiers.count(tiers[0]) == len(tiers):
        _read_run(cascade, rnd, range(len(tiers)), dsts)   # the usual get: one run, one tier, nothing to decode
        return
    slow = [k for k, t in enumerate(tiers) if t >= slow_tiers and k not in decode]
    if len(slow) < 2:
        slow = []
    in_flight = []
    if slow:
        pool = _readers.get()
        for ks in _runs(cascade, [tiers[k] for k in slow], [dsts[rnd.at[k]].nbytes for k in slow]):
            in_flight.append(pool.submit(_read_run, cascade, rnd, [slow[j] for j in ks], dsts))
    taken = set(slow)
    try:
        run: list[int] = []   # neighbours in the call of one tier, none to decode: one read_many_into
        for k, t in enumerate(tiers):
            if k in taken:
                continue
            if run and (k in decode or t != tiers[run[0]]):
                _read_run(cascade, rnd, run, dsts)
                run = []
            if k in decode:
                _read_run(cascade, rnd, [k], dsts)
            else:
                run.append(k)
        if run:
            _read_run(cascade, rnd, run, dsts)
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


def _read_run(cascade: Cascade, rnd: Round, ks: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
    """Read the copies at positions ``ks`` of ``rnd`` (of one tier, none to decode when more than
    one) into their buffers; ``payloads`` are kept only for copies below the first tier (what a
    promotion copies)."""
    t = rnd.tiers[ks[0]]
    tier, at, entries = cascade.tiers[t], rnd.at, rnd.entries
    if len(ks) == 1 and ks[0] in rnd.decode:
        k = ks[0]
        entry = entries[k]
        try:
            payload = rnd.payloads[k] = cascade.read_copy(entry, t, _own_payloads)
            decoded = rnd.decoded[k] = cascade.transcoder.decode(entry.namespace_id, entry.raw_size,
                                                                 entry.copies[t], payload, out=dsts[at[k]])
            rnd.n[k], rnd.codecs[k] = decoded.nbytes, 0
        except (BlockCorrupt, CodecError) as e:
            rnd.failed[k] = e
        return
    if len(ks) == len(at) and len(at) == len(dsts):   # the whole call, in order: no lists to pick
        sizes = tier.read_many_into([e.key for e in entries], dsts)
    else:
        sizes = tier.read_many_into([entries[k].key for k in ks], [dsts[at[k]] for k in ks])
    n, below = rnd.n, t > 0
    if not below and len(ks) == len(n) and set(map(type, sizes)) == _SIZES_ONLY:
        rnd.n = sizes   # the usual get: every copy of the round read whole from the first tier
        return
    for k, got in zip(ks, sizes):
        if type(got) is int:
            n[k] = got
            if below:
                rnd.payloads[k] = dsts[at[k]][:got]
        elif isinstance(got, BlockCorrupt):
            rnd.failed[k] = got
        else:
            raise got


def _complete(cascade: Cascade, rnd: Round, out: list, ks: range) -> list[int]:
    """Under one lock acquisition, in the callers' order: count, touch and promote the reads at
    positions ``ks`` of ``rnd`` (``out[at]``: each one's size and codec), then unpin them all (a
    block read stays pinned while the batch's promotions make room); drop each damaged copy
    (counted) and unpin its block. The touches go to each policy a run at a time
    (``touch_many``), in the same order. Returns the positions to plan again (their next copy,
    or a miss)."""
    again: list[int] = []
    policies = cascade.index.policies
    at, entries, tiers, n = rnd.at, rnd.entries, rnd.tiers, rnd.n
    hits, nbytes = [0] * len(cascade.tiers), [0] * len(cascade.tiers)
    # the reads that are not plain hits, in order: each ends a stretch of plain ones, touched first
    # (by position in ``ks``: a batch promoted block by block calls this once per block)
    failed, promote = rnd.failed, rnd.promote
    marked = [k for k in ks if k in failed or k in promote] if failed or promote else []
    with cascade.lock:
        start = ks.start
        for k in marked + [ks.stop]:
            _plain_hits(cascade, rnd, out, range(start, k), hits, nbytes)
            start = k + 1
            if k == ks.stop:
                break
            entry, t = entries[k], tiers[k]
            if k in rnd.failed:
                if t in entry.copies:
                    cascade.discard_corrupt_copy(entry, t)
                cascade.unpin(entry)
                again.append(at[k])
                continue
            hits[t] += 1
            nbytes[t] += n[k]
            policies[t].touch(entry.key)
            if not entry.doomed:   # (touched first: as it was read, before it moved)
                cascade.promote(entry, t, rnd.payloads.get(k), rnd.decoded.get(k))
            out[at[k]] = (n[k], rnd.codecs[k])
        failed = rnd.failed
        cascade.unpin_all(entries[ks.start:ks.stop] if not failed else
                          [entries[k] for k in ks if k not in failed])
        for t, k in enumerate(hits):   # counted once per batch: the same totals, under the same lock
            if k:
                cascade.served(t, k, nbytes[t])
    return again


def _plain_hits(cascade: Cascade, rnd: Round, out: list, ks: range, hits: list[int], nbytes: list[int]) -> None:
    """Count and touch the plain hits at positions ``ks`` of ``rnd`` (each tier's policy told its
    keys in one ``touch_many``, in order), and give each its ``out[at]``. Caller holds the lock."""
    if not ks:
        return
    a, b = ks.start, ks.stop
    tiers, entries, n = rnd.tiers[a:b], rnd.entries[a:b], rnd.n[a:b]
    policies = cascade.index.policies
    if tiers.count(tiers[0]) == len(tiers):   # one tier (the usual get)
        t = tiers[0]
        policies[t].touch_many([e.key for e in entries])
        hits[t] += len(tiers)
        nbytes[t] += sum(n)
    else:
        for t in sorted(set(tiers)):
            policies[t].touch_many([e.key for e, et in zip(entries, tiers) if et == t])
            hits[t] += tiers.count(t)
            nbytes[t] += sum(nk for nk, et in zip(n, tiers) if et == t)
    for i, nk, codec in zip(rnd.at[a:b], n, rnd.codecs[a:b]):
        out[i] = (nk, codec)


#: where staged copies land, one kept buffer per calling thread: touched once and reused, so
#: reading into it takes no page faults (a fresh buffer per read cost a fault per page)
_staging = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True)


def read_staged(cascade: Cascade, copies: Sequence[tuple[Entry, int]]) -> list:
    """The stored bytes of each pinned ``(entry, tier)`` copy, read as a get reads (``_execute``)
    into page-aligned parts of this thread's staging buffer (valid until its next call); in place
    of a copy that could not be read, the exception (``BlockCorrupt`` for a damaged one)."""
    rnd = Round(list(range(len(copies))), [e for e, _ in copies], [t for _, t in copies],
                [e.copies[t].codec for e, t in copies])
    spans = [-(-e.copies[t].stored_size // 4096) * 4096 for e, t in copies]   # O_DIRECT reads land in place
    buf, at, dsts = _staging.get(sum(spans)), 0, []
    for span in spans:
        dsts.append(buf[at:at + span])
        at += span
    try:
        _execute(cascade, rnd, dsts)
    except Exception as e:  # noqa: BLE001 - a failed read stands in for each copy it left unread
        for k in range(len(rnd)):
            if k not in rnd.payloads and k not in rnd.failed:
                rnd.failed[k] = e
    return [rnd.failed[k] if k in rnd.failed else rnd.payloads[k] if k in rnd.payloads else dsts[k][:rnd.n[k]]
            for k in range(len(rnd))]

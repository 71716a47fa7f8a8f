"""Copies between tiers with the I/O outside the store lock: writing victims down to make room
(``clear_room``), and copying a pinned block into another tier (``copy_out``, ``copy_out_many``:
write-through, demotions, promotions into a disk tier, prewarm).

Each copy is planned under the store lock (room made, the destination allocated, the blocks it
reads pinned), executed with the lock released (the read of the source, the codec, the write),
and recorded under the lock again, only if the block is still wanted. The books stay the
cascade's (``Cascade``): this module changes them only through its methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.errors import BlockCorrupt, BlockTooLarge, CodecError, TierFull, TierIOError
from kvstore.store.index import Entry
from kvstore.store.reads import read_staged
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.store.cascade import Cascade

#: what a failed copy into a tier raises when the failure is only "it did not fit / did not write"
PLACEMENT_ERRORS = (TierFull, TierIOError, BlockTooLarge)
#: victims one ``clear_room`` call evicts at most before leaving the rest to ``make_room`` (a
#: tier split by tenant can evict other tenants' blocks without making room for this one)
CLEAR_ROOM_MAX_VICTIMS = 64
#: victims ``clear_room`` picks under one lock acquisition and writes down together at most
WRITE_DOWN_BATCH = 64
#: times a caller without the lock makes room and tries its allocation again when another caller
#: took the room between its ``clear_room`` and its ``make_room``
ROOM_ATTEMPTS = 3
#: what ``copy_out`` did
COPIED, NO_ROOM, CORRUPT = "copied", "no_room", "corrupt"


class RoomNotReady(TierFull):
    """Room in tier ``tier`` needs a victim written down (disk or network I/O), which never runs
    under the lock: the caller lets go of it, calls ``clear_room`` and tries again."""

    def __init__(self, tier: int, message: str) -> None:
        super().__init__(message)
        self.tier = tier


class Transfers:
    """The copies of one cascade's blocks between its tiers that do I/O."""

    def __init__(self, cascade: Cascade) -> None:
        self.cascade = cascade
        # one per source tier: writing a victim down to make room below reads through the next one's
        self._scratch = [Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)
                         for _ in cascade.tiers]

    def clear_room(self, t: int, nbytes: int, namespace_id: bytes, blocks: int = 1,
                   keep: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Make room as ``make_room`` does, for ``blocks`` blocks of ``nbytes``, for a caller that
        does not hold the lock, where tier ``t``'s victims go down by a disk or network write (or
        are read from disk): the victims' copies below are written with the lock released, so other
        requests (a get of hot blocks) never wait on the I/O, only this caller does. Room for a run
        (``blocks`` > 1) in a CPU tier is made by picking up to ``WRITE_DOWN_BATCH`` victims at a
        time and writing them down together (``write_down_many``); otherwise one at a time. Each is
        pinned meanwhile (nobody else evicts it; a delete dooms it)
        and marked ``writing_down`` (nobody else writes it down). Best effort: it returns once there
        is room, or leaves what it could not do (every block pinned, a race lost to another put, a
        tier split by tenant) to the caller's ``make_room``. It stops where the policy names a key
        of ``keep`` (a put's parents: one by one, they would not be victims). Takes the lock itself."""
        if not self.writes_down_slowly(t):
            return
        tier, policy = self.cascade.tiers[t], self.cascade.index.policies[t]
        try:
            need = tier.footprint(nbytes) * blocks
        except BlockTooLarge:
            return
        if tier.free_bytes_for(namespace_id) >= need:   # the common case, without the lock (make_room rechecks)
            return
        # victims go down together only where copy_out_many writes them with one call (a run of
        # puts making room in a CPU tier); elsewhere one at a time, as a victim stays pinned until
        # its batch is written, and a pinned victim is room nobody else can make meanwhile
        batch = WRITE_DOWN_BATCH if blocks > 1 and isinstance(tier, CpuTier) else 1
        left = CLEAR_ROOM_MAX_VICTIMS * blocks
        while left > 0:
            victims: list[Entry] = []
            with self.cascade.lock:
                free = tier.free_bytes_for(namespace_id)
                while free < need and left > 0 and len(victims) < batch:
                    # a policy that names one at a time (prefix-aware) is asked again: each victim
                    # named is pinned and, to its policy, as if gone (``leaving``)
                    keys = policy.pick_victims(self.cascade.is_pinned, min(batch - len(victims), left))
                    if not keys:
                        break
                    for key in keys:
                        if key in keep:
                            left = 0
                        if free >= need or left <= 0:
                            break
                        left -= 1
                        entry = self.cascade.index.entries[key]
                        if any(i > t for i in entry.copies):   # a copy below already: evicting is a drop
                            self.cascade.evict_copy(t, key)
                            free = tier.free_bytes_for(namespace_id)
                            continue
                        self.cascade.pin_entry(entry)
                        entry.writing_down = True
                        self.cascade.index.leaving(entry, t)
                        victims.append(entry)
                        free += tier.footprint(entry.copies[t].stored_size)   # once written down
            if not victims:
                return
            self.write_down_many(victims, t)

    def writes_down_slowly(self, t: int) -> bool:
        """Whether demoting a victim of tier ``t`` is I/O (a disk or network read or write), not a
        copy from memory to memory."""
        tiers = self.cascade.tiers
        return t + 1 < len(tiers) and not (tiers[t].in_memory and tiers[t + 1].in_memory)

    def write_down_many(self, entries: list[Entry], t: int) -> None:
        """Demote pinned victims of tier ``t`` to the tier below (``copy_out_many``: the I/O outside
        the lock), then evict each one's copy in ``t`` (kept if someone pinned it meanwhile: it is
        then clean, and a later eviction is a drop). A failed demotion loses its block, as any
        eviction does."""
        outcomes: list[str | None] = [None] * len(entries)
        unexpected = None
        try:
            outcomes = list(self.copy_out_many(entries, t, t + 1))
        except BaseException as e:   # noqa: BLE001 - unpinned below, then raised
            unexpected = e
        with self.cascade.lock:
            for entry, outcome in zip(entries, outcomes):
                entry.writing_down = False
                if outcome == COPIED:
                    self.cascade.counters["demotions"] += 1
                    self.cascade.counters["demotions_outside_lock"] += 1
                else:
                    self.cascade.counters["demotion_failures"] += 1
                self.cascade.unpin(entry)   # doomed: freed here, every copy with it
                if (unexpected is None and self.cascade.index.entries.get(entry.key) is entry and t in entry.copies
                        and not self.cascade.is_pinned(entry.key)):
                    self.cascade.drop_copy(entry, t)
                    if not len(entry.copies):
                        self.cascade.counters["evictions"] += 1
                elif self.cascade.index.entries.get(entry.key) is entry:
                    self.cascade.index.copies_changed(entry)   # kept: its chain's true states again
        if unexpected is not None:
            raise unexpected

    def copy_out_many(self, entries: Sequence[Entry], src: int, dst: int) -> list[str]:
        """``copy_out`` for blocks the caller has pinned, planned and recorded together: room in
        ``dst`` made for all of them first (``clear_room``), their copies in ``src`` taken where
        each is one view of memory (a CPU arena slot: no scratch buffer is shared between them) or
        else read several at once (``reads.read_staged``), their writes into ``dst`` made by one
        ``Tier.write_many_unsynced`` (neighbouring slots of a disk tier in one call). A copy of
        several pieces, and a lone block, go one by one (``copy_out``). Returns each block's
        outcome. Takes the lock itself."""
        outcomes: list[str] = [NO_ROOM] * len(entries)
        placed_all = []   # (position, entry, its placement in dst)
        alone: list[int] = []
        todo = [k for k, e in enumerate(entries) if dst not in e.copies and src in e.copies]
        for k, entry in enumerate(entries):
            if dst in entry.copies:
                outcomes[k] = COPIED
        src_tier = self.cascade.tiers[src]
        if len(todo) > 1:
            first = entries[todo[0]]
            self.clear_room(dst, max(entries[k].copies[src].stored_size for k in todo), first.namespace_id,
                            blocks=len(todo))
            if isinstance(src_tier, CpuTier):
                payloads: list = [v[0] if len(v := src_tier.view(entries[k].key)) == 1 else None for k in todo]
            else:   # into this thread's staging buffer: nothing below reads through it before the writes
                payloads = read_staged(self.cascade, [(entries[k], src) for k in todo])
        else:
            alone, payloads = todo, []
        for k, payload in zip(todo, payloads):
            entry = entries[k]
            record = entry.copies.get(src)
            if payload is None or record is None:
                alone.append(k)
                continue
            if isinstance(payload, Exception) and not isinstance(payload, (BlockCorrupt, CodecError)):
                continue   # the read failed: no copy
            try:
                if isinstance(payload, Exception):
                    raise payload
                placed = self.cascade.transcoder.place(entry.namespace_id, entry.raw_size, dst, record, payload,
                                                       downward=dst > src)
            except (BlockCorrupt, CodecError):
                outcomes[k] = self._damaged(entry, src, record)
                continue
            placed_all.append((k, entry, placed))
        writing = []
        with self.cascade.lock:
            for k, entry, placed in placed_all:
                if dst in entry.copies:
                    outcomes[k] = COPIED
                    continue
                try:
                    self.cascade.make_room(dst, placed.record.stored_size, entry.namespace_id)
                    self.cascade.tiers[dst].allocate(placed.record)
                except RoomNotReady:
                    alone.append(k)   # copy_out clears the room below and tries again
                    continue
                except PLACEMENT_ERRORS:
                    continue
                writing.append((k, entry, placed))
        try:
            failed = self.cascade.tiers[dst].write_many_unsynced([p.record for _, _, p in writing],
                                                         [p.payload for _, _, p in writing], durable=False)
        except BaseException:
            with self.cascade.lock:
                for _, _, placed in writing:
                    self.cascade.tiers[dst].drop(placed.record.key)
            raise
        with self.cascade.lock:
            for (k, entry, placed), error in zip(writing, failed):
                if error is not None or entry.doomed or self.cascade.index.entries.get(entry.key) is not entry:
                    self.cascade.tiers[dst].drop(placed.record.key)   # not written, or a copy nobody will read
                    continue
                self.cascade.add_copy(entry, dst, placed)
                outcomes[k] = COPIED
        for k in sorted(alone):
            outcomes[k] = self.copy_out(entries[k], src, dst)
        return outcomes

    def copy_out(self, entry: Entry, src: int, dst: int, data=None, decoded=None) -> str:
        """Copy a block the caller has pinned (or that is still invisible) from tier ``src`` to
        tier ``dst`` with the lock released for every I/O: the read of ``src`` (skipped when
        ``data`` holds its payload already; ``decoded``: its raw bytes, if at hand), room in
        ``dst`` (``clear_room``, then ``make_room`` under the lock, tried again if another caller
        took it), the write. The copy is recorded only if the block is still wanted (not deleted
        meanwhile). Returns ``COPIED`` (or ``dst`` had a copy already), ``NO_ROOM`` (the tier
        refused it, or its write failed) or ``CORRUPT`` (the ``src`` copy was damaged: dropped,
        counted). Takes the lock itself."""
        record = entry.copies.get(src)
        if dst in entry.copies:
            return COPIED
        if record is None:
            return NO_ROOM
        if data is None:
            # room below first, and into this tier's own buffer: writing another victim down to
            # make that room reads it through the next tier's
            self.clear_room(dst, record.stored_size, entry.namespace_id)
            try:
                data = self.cascade.read_copy(entry, src, self._scratch[src])
            except (BlockCorrupt, CodecError, KeyError):
                return self._damaged(entry, src, record)
        try:
            placed = self.cascade.transcoder.place(entry.namespace_id, entry.raw_size, dst, record, data,
                                           downward=dst > src, decoded=decoded)
        except (BlockCorrupt, CodecError):
            return self._damaged(entry, src, record)
        target = placed.record
        for attempt in range(ROOM_ATTEMPTS):
            if attempt:
                self.clear_room(dst, target.stored_size, entry.namespace_id)
            with self.cascade.lock:
                if dst in entry.copies:
                    return COPIED
                try:
                    self.cascade.make_room(dst, target.stored_size, entry.namespace_id)
                    self.cascade.tiers[dst].allocate(target)
                    break
                except RoomNotReady:
                    continue
                except PLACEMENT_ERRORS:
                    return NO_ROOM
        else:
            return NO_ROOM
        try:
            self.cascade.tiers[dst].write_unsynced(target, placed.payload, durable=False)
        except PLACEMENT_ERRORS:
            with self.cascade.lock:
                self.cascade.tiers[dst].drop(target.key)
            return NO_ROOM
        except BaseException:
            with self.cascade.lock:
                self.cascade.tiers[dst].drop(target.key)
            raise
        with self.cascade.lock:
            if entry.doomed or self.cascade.index.entries.get(entry.key) is not entry:
                self.cascade.tiers[dst].drop(target.key)   # a copy nobody will read
                return NO_ROOM
            self.cascade.add_copy(entry, dst, placed)
        return COPIED

    def _damaged(self, entry: Entry, src: int, record) -> str:
        """A copy in ``src`` failed its checksum or decode: dropped (counted) unless it changed
        meanwhile; ``CORRUPT``. Takes the lock itself."""
        with self.cascade.lock:
            if entry.copies.get(src) is record:
                self.cascade.discard_corrupt_copy(entry, src)
        return CORRUPT

"""Copies between tiers with the I/O outside the store lock: writing victims down to make room
(``clear_room``), and copying pinned blocks into another tier (``copy_out_many``, and
``copy_out`` for one: write-through, demotions, promotions into a disk tier, prewarm, a lease's
staging into the CPU arena, flush).

Each copy is planned under the store lock (room made, the destination allocated, the blocks it
reads pinned), executed with the lock released (the read of the source, the codec, the write),
and recorded under the lock again, only if the block is still wanted. The books stay the
cascade's (``Cascade``): this module changes them only through its methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

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
#: what ``warm`` did for one block (or copy_out's NO_ROOM, CORRUPT)
WARMED, ALREADY_WARM = "warmed", "already"


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

    def clear_room(self, t: int, nbytes: int, namespace_id: bytes, blocks: int = 1,
                   keep: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Make room as ``make_room`` does, for ``blocks`` blocks of ``nbytes``, for a caller that
        does not hold the lock, where tier ``t``'s victims go down by a disk or network write (or
        are read from disk): the victims' copies below are written with the lock released, so other
        requests (a get of hot blocks) never wait on the I/O, only this caller does. Each victim is
        pinned meanwhile (nobody else evicts it; a delete dooms it) and marked ``writing_down``
        (nobody else writes it down). Best effort: it returns once there
        is room, or leaves what it could not do (every block pinned, a race lost to another put, a
        tier split by tenant) to the caller's ``make_room``. It stops where the policy names a key
        of ``keep`` (a put's parents: one by one, they would not be victims). Where evicting from
        tier ``t`` is no I/O (the last tier drops its victims; a memory tier demotes them into the
        memory tier below), room for several ``blocks`` is made the same way, each victim evicted
        under the lock as named: a run of puts into a full tier then goes in as one run, not block
        by block. Takes the lock itself."""
        slow = self.writes_down_slowly(t)
        if not slow and blocks == 1:
            return   # ``make_room`` evicts it under the caller's lock
        tier, policy = self.cascade.tiers[t], self.cascade.index.policies[t]
        try:
            need = tier.footprint(nbytes) * blocks
        except BlockTooLarge:
            return
        if tier.free_bytes_for(namespace_id) >= need:   # the common case, without the lock (make_room rechecks)
            return
        # victims go down together (``write_down_many``, up to ``WRITE_DOWN_BATCH``) only where
        # copy_out_many writes them with one call (a run of puts making room in a CPU tier);
        # elsewhere one at a time, as a victim stays pinned until its batch is written, and a
        # pinned victim is room nobody else can make meanwhile
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
                    whole: list[Entry] = []   # victims whose block leaves with its copy: dropped together
                    for key in keys:
                        if key in keep:
                            left = 0
                        if free >= need or left <= 0:
                            break
                        left -= 1
                        entry = self.cascade.index.entries[key]
                        if self.cascade.evicts_whole(entry, t):
                            whole.append(entry)
                            free += tier.footprint(entry.copies.stored(t)[0])
                            continue
                        whole = self._evict_whole(whole)
                        if not slow or any(i > t for i in entry.copies):   # a drop, or a copy in memory
                            try:
                                self.cascade.evict_copy(t, key)
                            except RoomNotReady:   # the memory tier below must write one down first:
                                left = 0           # ``make_room``'s callers do that
                                break
                            free = tier.free_bytes_for(namespace_id)
                            continue
                        self.cascade.pin_entry(entry)
                        entry.writing_down = True
                        self.cascade.index.leaving(entry, t)
                        victims.append(entry)
                        free += tier.footprint(entry.copies[t].stored_size)   # once written down
                    if whole:
                        self._evict_whole(whole)
                        free = tier.free_bytes_for(namespace_id)   # (a tier split by tenant may have freed less)
            if not victims:
                return
            self.write_down_many(victims, t)

    def _evict_whole(self, entries: list[Entry]) -> list[Entry]:
        """Evict victims that ``evicts_whole`` together; the list to collect the next ones in."""
        if entries:
            self.cascade.evict_entries(entries)
        return []

    def victims_ahead(self, t: int, keys: Sequence[bytes], parent_keys: Sequence[bytes | None]) -> set[bytes] | None:
        """Whether tier ``t``'s policy names the same victims before blocks ``keys`` (in order, each
        with its parent's key) get a copy there as while they get one one by one, and the keys
        ``clear_room`` must stop at. LRU (``picks_ahead``): yes, none. The prefix-aware policy:
        where each block's parent gets its copy in this run too, or is none, or is in tier ``t``
        — the blocks are then its newest leaves, never a victim while an older leaf is unpinned —
        and until it would name such a parent in tier ``t`` (one by one, the parent is no longer a
        leaf once its child arrives; its own chain's newest block is named instead). A block whose
        prefix is not in tier ``t`` is an orphan leaf, its first victim: None, those go one by one.
        Read without the lock: a hint."""
        policy = self.cascade.index.policies[t]
        if policy.picks_ahead:
            return set()
        if not policy.uses_chains:
            return None
        entries, new, keep = self.cascade.index.entries, set(), set()
        for key, parent_key in zip(keys, parent_keys):
            if parent_key is not None and parent_key not in new:
                held = entries.get(parent_key)
                if held is None or t not in held.copies:
                    return None
                keep.add(held.key)
            new.add(key)
        return keep

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

    def copy_out(self, entry: Entry, src: int, dst: int, data=None, decoded=None) -> str:
        """``copy_out_many`` for one block; ``data``: its payload in ``src`` when the caller has
        read it already (``decoded``: its raw bytes, if at hand)."""
        return self.copy_out_many([entry], src, dst, None if data is None else [(data, decoded)])[0]

    def copy_out_many(self, entries: Sequence[Entry], src: int, dst: int, given: Sequence | None = None) -> list[str]:
        """Copy blocks the caller has pinned (or that are still invisible) from tier ``src`` to tier
        ``dst``, planned, executed and recorded together, every I/O with the lock released: room
        in ``dst`` for all of them (``clear_room``); their payloads (``given``: ``(payload, raw
        bytes or None)`` per block, when the caller has read them; else a copy in ``src`` that is
        one view of memory, a CPU arena slot, as it lies, and the others read several at once,
        ``reads.read_staged``) in ``dst``'s form; room and slots taken under one lock acquisition
        (``make_room``; blocks whose room needs a write down first go round again, at most
        ``ROOM_ATTEMPTS`` times in all, read again); one ``Tier.write_many_unsynced``
        (neighbouring slots of a disk tier in one call); each copy recorded under the lock only if
        its block is still wanted (not deleted meanwhile). Per block ``COPIED`` (or ``dst`` had a
        copy already), ``NO_ROOM`` (refused, or its read or write failed) or ``CORRUPT`` (its
        ``src`` copy was damaged: dropped, counted). Takes the lock itself."""
        cascade = self.cascade
        outcomes: list[str] = [COPIED if dst in e.copies else NO_ROOM for e in entries]
        todo = [k for k, e in enumerate(entries) if dst not in e.copies and src in e.copies]
        src_tier, dst_tier = cascade.tiers[src], cascade.tiers[dst]
        for _ in range(ROOM_ATTEMPTS):
            records = {k: entries[k].copies.get(src) for k in todo}
            todo = [k for k in todo if records[k] is not None]
            if not todo:
                break
            self.clear_room(dst, max(records[k].stored_size for k in todo), entries[todo[0]].namespace_id,
                            blocks=len(todo))
            if given is not None:
                payloads = [given[k] for k in todo]
            else:   # read after the room is made: writing victims down reads through the same buffer
                views = [src_tier.view(entries[k].key) if isinstance(src_tier, CpuTier) else () for k in todo]
                unread = [(entries[k], src) for k, v in zip(todo, views) if len(v) != 1]
                staged = iter(read_staged(cascade, unread) if unread else ())
                payloads = [(v[0] if len(v) == 1 else next(staged), None) for v in views]
            placed_all = []   # (position, entry, its placement in dst)
            for k, (payload, decoded) in zip(todo, payloads):
                entry = entries[k]
                if isinstance(payload, Exception) and not isinstance(payload, (BlockCorrupt, CodecError, KeyError)):
                    continue   # the read failed: no copy
                try:
                    if isinstance(payload, Exception):
                        raise payload
                    placed = cascade.transcoder.place(entry.namespace_id, entry.raw_size, dst, records[k], payload,
                                                      downward=dst > src, decoded=decoded)
                except (BlockCorrupt, CodecError, KeyError):
                    with cascade.lock:   # dropped (counted) unless it changed meanwhile
                        if entry.copies.get(src) is records[k]:
                            cascade.discard_corrupt_copy(entry, src)
                    outcomes[k] = CORRUPT
                    continue
                placed_all.append((k, entry, placed))
            writing, todo = [], []
            with cascade.lock:
                for k, entry, placed in placed_all:
                    if dst in entry.copies:
                        outcomes[k] = COPIED
                        continue
                    try:
                        cascade.make_room(dst, placed.record.stored_size, entry.namespace_id)
                        dst_tier.allocate(placed.record)
                    except RoomNotReady:
                        todo.append(k)   # the next round clears the room below first
                        continue
                    except PLACEMENT_ERRORS:
                        continue
                    writing.append((k, entry, placed))
            try:
                failed = dst_tier.write_many_unsynced([p.record for _, _, p in writing],
                                                      [p.payload for _, _, p in writing], durable=False)
            except BaseException:
                with cascade.lock:
                    for _, _, placed in writing:
                        dst_tier.drop(placed.record.key)
                raise
            with cascade.lock:
                for (k, entry, placed), error in zip(writing, failed):
                    if error is not None or entry.doomed or cascade.index.entries.get(entry.key) is not entry:
                        dst_tier.drop(placed.record.key)   # not written, or a copy nobody will read
                        continue
                    cascade.add_copy(entry, dst, placed)
                    outcomes[k] = COPIED
        return outcomes

    def warm(self, entry: Entry) -> str:
        """Give a block a copy in the CPU tier ahead of traffic (``kvstore prewarm``, ``kvstore
        pin``): the copy a read's promotion makes, made before the first request pays the slow
        tier, so a warmed block is indistinguishable from a promoted one. Copies its fastest copy
        unless it has one in the CPU tier or a faster one already, or is gone. The block is pinned
        while its copy is read and room is made, both with the lock released (``copy_out``).
        Takes the lock itself."""
        cascade = self.cascade
        c = cascade.cpu_index
        with cascade.lock:
            if c is None or not entry.visible or entry.fastest <= c:
                return ALREADY_WARM
            src = entry.fastest
            cascade.pin_entry(entry)
        try:
            done = self.copy_out(entry, src, c)
        finally:
            with cascade.lock:
                cascade.unpin(entry)
        if done == COPIED:
            cascade.count("prewarmed")
            return WARMED
        if done == NO_ROOM:
            cascade.count("prewarm_no_room")
        return done

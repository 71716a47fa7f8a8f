"""Fixed-size slot allocation inside one pre-allocated arena (shared by the CPU and GPU tiers).

The arena is carved into equal slots once; a block takes ``ceil(size / slot_bytes)`` slots.
There is no per-block malloc and no external fragmentation: any free slot fits any piece.
Slots handed out together are usually adjacent (the free lists are kept so that pops ascend),
so a block is typically one extent and is copied with one memcpy; after churn it may be a few.

Owned segments (``segment_bytes``): the slots may also be grouped into segments of which each
holds blocks of one owner (a tenant) only, so that a client of that tenant can be handed exactly
its tenant's segments to map and nothing else. A segment is claimed by an owner when it needs
room and none of its segments has any; it goes back to the pool when its last block leaves.
When a segment passes to another owner than its last one, ``on_reassign`` runs first (the CPU
tier gives the segment fresh memory then, so a client that mapped it earlier sees none of the
new owner's bytes) and the segment's generation counts up. No extent spans two segments.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvstore.buffers import Extent
from kvstore.errors import BlockTooLarge, TierFull


class SlotHolder(Protocol):
    """What ``SlotTable.keep_slots_in`` keeps a block's slot in: one object per key, found in a
    mapping the table is given (the store's index entries)."""

    slot: object   # None: not held here


class SlotTable:
    """Which slots each block holds, and the free slots.

    A block's slot (a one-slot block's: the free list's own int object, so it costs nothing
    more; a larger block's: ``(extents, nbytes, slots)``) is kept in the table's own dict, or,
    once ``keep_slots_in`` gave it a mapping of key -> ``SlotHolder`` (the store's index), in
    the ``slot`` of the key's holder where the mapping has one when the room is taken: one dict
    slot per block then serves the index and this table. A block held in a holder is found
    through the mapping, so the mapping's owner keeps a key's holder in it for as long as the
    block is held here, or hands it back (``let_go``): the store indexes an entry before taking
    its room, and forgets it after dropping its copies, handing back the room of a copy still
    being written."""


    def __init__(self, arena_bytes: int, slot_bytes: int, tier_name: str, segment_bytes: int | None = None,
                 on_reassign: Callable[[int], None] | None = None) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        self.slot_bytes = slot_bytes
        self.num_slots = arena_bytes // slot_bytes
        self.tier_name = tier_name
        self.owned = segment_bytes is not None
        per = max(1, (segment_bytes or 0) // slot_bytes) if self.owned else max(1, self.num_slots)
        self.segment_slots = per
        n_segments = max(1, -(-self.num_slots // per))
        # one free list per segment, each popping in ascending slot order
        self._free = [list(range(min(self.num_slots, (s + 1) * per) - 1, s * per - 1, -1)) for s in range(n_segments)]
        self._owner: list[str | None] = [None] * n_segments
        self._last_owner: list[str | None] = [None] * n_segments
        self.generations = [1] * n_segments
        self._on_reassign = on_reassign
        #: key -> a one-slot block's slot number (its bytes are in ``_nbytes``), or a larger
        #: block's ``(extents, nbytes, slots)``, for blocks without a holder
        self._blocks: dict[bytes, int | tuple[list[Extent], int, list[int]]] = {}
        #: key -> the holder whose ``slot`` keeps the same (``keep_slots_in``); None: none given
        self._holders: Mapping[bytes, SlotHolder] | None = None
        self._in_holders = 0   # blocks held in holders
        #: the bytes of the one-slot block in each slot (4 B a slot, made with the table)
        self._nbytes = array.array("I" if slot_bytes < 1 << 32 else "Q", [0]) * self.num_slots
        self.payload_bytes = 0   # the blocks' own bytes; the rest of their slots is slack
        self._lock = threading.Lock()

    def keep_slots_in(self, holders: Mapping[bytes, SlotHolder]) -> None:
        """From now on keep the slot of each block whose key ``holders`` maps when its room is
        taken in that holder's ``slot`` (see the class docstring); blocks held in an earlier
        mapping's holders move into the table's own dict."""
        with self._lock:
            if self._holders is not None and self._in_holders:
                for key, holder in list(self._holders.items()):
                    if holder.slot is not None:
                        self._blocks[key], holder.slot = holder.slot, None
            self._holders, self._in_holders = holders, 0

    def let_go(self, key: bytes, holder: SlotHolder) -> None:
        """``holder`` leaves the mapping while the table still holds ``key`` in it: the table
        keeps it in its own dict from now on."""
        with self._lock:
            if holder.slot is not None:
                self._blocks[key], holder.slot = holder.slot, None
                self._in_holders -= 1

    def _held(self, key: bytes):
        """What the table keeps for ``key``, or None."""
        if self._holders is not None:
            holder = self._holders.get(key)
            if holder is not None and holder.slot is not None:
                return holder.slot
        return self._blocks.get(key)

    def _keep(self, key: bytes, held) -> None:
        holder = None if self._holders is None else self._holders.get(key)
        if holder is None:
            self._blocks[key] = held
        else:
            holder.slot = held
            self._in_holders += 1

    def _forget(self, key: bytes):
        """Stop keeping ``key``: what was kept for it, or None."""
        if self._holders is not None:
            holder = self._holders.get(key)
            if holder is not None and holder.slot is not None:
                held, holder.slot = holder.slot, None
                self._in_holders -= 1
                return held
        return self._blocks.pop(key, None)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def segment_bytes(self) -> int:
        return self.segment_slots * self.slot_bytes

    @property
    def num_segments(self) -> int:
        return len(self._free)

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def footprint(self, nbytes: int) -> int:
        n = self.slots_for(nbytes)
        if n > self.num_slots:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the {self.tier_name} tier "
                                f"({self.capacity_bytes} bytes)")
        return n * self.slot_bytes

    def free_bytes_for(self, owner: str | None) -> int:
        """Bytes a block of ``owner`` could take now: its own segments' free slots and the
        unclaimed segments (all slots when segments are not owned)."""
        with self._lock:
            return self._free_slots_for(owner) * self.slot_bytes

    def _free_slots_for(self, owner: str | None) -> int:
        if not self.owned:
            return len(self._free[0])
        return sum(len(f) for s, f in enumerate(self._free) if self._owner[s] in (owner, None))

    def allocate(self, key: bytes, nbytes: int, owner: str | None = None) -> list[Extent]:
        n = self.slots_for(nbytes)
        with self._lock:
            if self._held(key) is not None:
                raise KeyError(f"{key.hex()} already allocated in {self.tier_name}")
            if not self.owned:   # one pool: the next ``n`` slots off its free list (ascending pops)
                free = self._free[0]
                if n > len(free):
                    raise TierFull(f"{self.tier_name} tier has {len(free)} free slots, needs {n}")
                slots = free[-n:]
                del free[-n:]
                slots.reverse()   # the order n pops would have taken them in
            else:
                free = self._free_slots_for(owner)
                if n > free:
                    raise TierFull(f"{self.tier_name} tier has {free} free slots, needs {n}")
                slots = []
                own = [s for s in range(self.num_segments) if self._owner[s] == owner]
                for s in own + [s for s in range(self.num_segments) if self._owner[s] is None]:
                    if len(slots) == n:
                        break
                    if not self._free[s]:
                        continue
                    if self._owner[s] is None:
                        self._claim(s, owner)
                    take = min(n - len(slots), len(self._free[s]))
                    slots += [self._free[s].pop() for _ in range(take)]
            if len(slots) == 1:
                held = slots[0]
                self._nbytes[held] = nbytes
            else:
                held = _extents_held(slots, self.slot_bytes, nbytes, self.segment_slots)
            self._keep(key, held)
            self.payload_bytes += nbytes
            return self._unpack(held)[0]

    def takes_runs(self, nbytes: int) -> bool:
        """Whether ``allocate_run`` takes blocks of ``nbytes``: one slot each, in one pool."""
        return not self.owned and 0 < nbytes <= self.slot_bytes

    def allocate_run(self, keys: list[bytes], nbytes: int) -> int:
        """``allocate`` for as many of ``keys`` as there are free slots, in order, ``nbytes`` each
        (``takes_runs`` must hold: the store's runs of small blocks); returns how many were
        allocated. One lock acquisition and one slice of the free list for the run."""
        if not self.takes_runs(nbytes):
            raise ValueError(f"allocate_run takes blocks of one slot in one pool, not {nbytes} bytes here")
        with self._lock:
            free = self._free[0]
            n = min(len(keys), len(free))
            keys = keys[:n]
            blocks, get = self._blocks, (self._holders or {}).get
            holders = [get(key) for key in keys]   # (``_held`` and ``_keep``, inline: once per block of a run)
            for key, holder in zip(keys, holders):
                if key in blocks or (holder is not None and holder.slot is not None):
                    raise KeyError(f"{key.hex()} already allocated in {self.tier_name}")
            taken = free[len(free) - n:]
            del free[len(free) - n:]
            sizes = self._nbytes
            for key, holder, slot in zip(keys, holders, reversed(taken)):   # the order n pops would take them in
                if holder is None:
                    blocks[key] = slot
                else:
                    holder.slot = slot
                sizes[slot] = nbytes
            self._in_holders += n - holders.count(None)
            self.payload_bytes += n * nbytes
            return n

    def _claim(self, s: int, owner: str | None) -> None:
        if self._last_owner[s] is not None and self._last_owner[s] != owner:
            if self._on_reassign is not None:
                self._on_reassign(s)
            self.generations[s] += 1
        self._owner[s] = self._last_owner[s] = owner

    def lookup(self, key: bytes) -> tuple[list[Extent], int]:
        """A held block's extents and bytes (``KeyError`` if none)."""
        held = self._held(key)
        if held is None:
            raise KeyError(key)
        return self._unpack(held)

    def _unpack(self, held) -> tuple[list[Extent], int]:
        if type(held) is int:
            nbytes = self._nbytes[held]
            return ([(held * self.slot_bytes, nbytes)] if nbytes else []), nbytes
        return held[0], held[1]

    def span(self, key: bytes) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a block held in one slot, None for a larger one (``lookup``
        has its extents): one dict lookup and no list, for the copy loops of whole batches."""
        held = self._held(key)
        if type(held) is int:
            return held * self.slot_bytes, self._nbytes[held]
        if held is None:
            raise KeyError(key)
        return None

    def spans(self, keys) -> list:
        """``span`` of each key, in one call (a batch's copy loop); in place of a key not held,
        its ``KeyError``."""
        holders, blocks, sizes, slot_bytes, out = self._holders or {}, self._blocks, self._nbytes, self.slot_bytes, []
        for key in keys:
            holder = holders.get(key)   # (``_held``, inline: once per block of a batch)
            held = None if holder is None else holder.slot
            if held is None:
                held = blocks.get(key)
            if type(held) is int:
                out.append((held * slot_bytes, sizes[held]))
            else:
                out.append(KeyError(key) if held is None else None)
        return out

    def release(self, key: bytes) -> int:
        """Free a block's slots; returns the bytes it accounted (0 if absent)."""
        return self.release_many((key,))

    def release_many(self, keys) -> int:
        """``release`` of each key under one lock acquisition; the bytes they accounted."""
        freed = 0
        with self._lock:
            for key in keys:
                held = self._forget(key)
                if held is None:
                    continue
                if type(held) is int:   # one slot (most blocks)
                    self.payload_bytes -= self._nbytes[held]   # (a slot's ``_nbytes`` is rewritten when next taken)
                    slots: Sequence[int] = (held,)
                else:
                    self.payload_bytes -= held[1]
                    slots = sorted(_slots_of(held), reverse=True)
                for slot in slots:
                    self._free[slot // self.segment_slots].append(slot)
                if self.owned:
                    for s in {slot // self.segment_slots for slot in slots}:
                        if len(self._free[s]) == self._segment_size(s):
                            self._owner[s] = None      # empty: back to the pool (``_last_owner`` kept)
                freed += len(slots) * self.slot_bytes
        return freed

    def _segment_size(self, s: int) -> int:
        return min(self.num_slots, (s + 1) * self.segment_slots) - s * self.segment_slots

    def segment_of(self, offset: int) -> int:
        return offset // self.segment_bytes

    def segments_of(self, keys) -> set[int]:
        """The segments holding a slot of any of the blocks ``keys`` held here."""
        with self._lock:
            return {slot // self.segment_slots for held in map(self._held, keys) if held is not None
                    for slot in _slots_of(held)}

    def if_owned_by(self, s: int, owner: str, action: Callable[[], object]) -> object | None:
        """``action()`` if segment ``s`` belongs to ``owner``, atomically with respect to the
        segment passing to another owner (which cannot happen while ``action`` runs); else None."""
        with self._lock:
            if not self.owned or not 0 <= s < self.num_segments or self._owner[s] != owner:
                return None
            return action()

    def __contains__(self, key: bytes) -> bool:
        return self._held(key) is not None

    def __len__(self) -> int:
        return len(self._blocks) + self._in_holders


def _extents_held(slots: list[int], slot_bytes: int, nbytes: int, segment_slots: int):
    """What the table keeps for a block in more than one slot: its extents, bytes and slots."""
    return _coalesce(sorted(slots), slot_bytes, nbytes, segment_slots), nbytes, slots


def _slots_of(held) -> list[int]:
    return [held] if type(held) is int else held[2]


def _coalesce(sorted_slots: list[int], slot_bytes: int, nbytes: int, segment_slots: int) -> list[Extent]:
    """Turn slot indices into (offset, length) runs covering exactly ``nbytes``; a run never
    crosses a segment boundary (a client may have mapped one segment and not the next)."""
    extents: list[Extent] = []
    remaining = nbytes
    start = prev = sorted_slots[0]
    for s in sorted_slots[1:] + [None]:
        if s is not None and s == prev + 1 and s % segment_slots != 0:
            prev = s
            continue
        length = min((prev - start + 1) * slot_bytes, remaining)
        if length > 0:
            extents.append((start * slot_bytes, length))
        remaining -= length
        if s is not None:
            start = prev = s
    return extents

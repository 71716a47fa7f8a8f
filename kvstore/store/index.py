"""The block index: one Entry per block, the prefix-chain links between entries, and what each
tier's eviction policy is told about those links.

The prefix-aware policy wants to know, per tier, how many of a block's children sit in that tier
or a faster one, and whether its parent is missing there (a broken prefix). Both change whenever
a block gains or loses a copy or a child; every such change goes through this module so the
policies never see a stale chain. Callers hold the store lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.keys import NAMESPACE_ID_BYTES, NamedByKey, block_key
from kvstore.store.policy import EvictionPolicy
from kvstore.tiers.base import BlockRecord


class PlainCopy:
    """Stands in for the record of a block's one copy that its tier, stored size and codec
    describe (a block put raw into a memory tier, a block a warm restart found), until the record
    is asked for: the copy's tier (``tier``, as a record's), ``stored_size`` and ``codec``. The
    rest of the record is its entry's (key, parent key, raw size) and its tier's (slots; a
    recovered NVMe copy's slot and checksum), so one instance is shared by every such block of a
    tier, size and codec (``PlainCopies``): an index of millions makes no record per block.
    Never changed once made."""

    __slots__ = ("tier", "stored_size", "codec")

    def __init__(self, tier: int, stored_size: int, codec: int) -> None:
        self.tier, self.stored_size, self.codec = tier, stored_size, codec

    def __repr__(self) -> str:
        return f"PlainCopy(tier={self.tier}, stored_size={self.stored_size}, codec={self.codec})"


class PlainCopies:
    """The ``PlainCopy`` of each tier, stored size and codec met so far (one recovery's, or a
    cascade's for its puts)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int, int], PlainCopy] = {}

    def __call__(self, tier: int, stored_size: int, codec: int) -> PlainCopy:
        made = self._made.get((tier, stored_size, codec))
        if made is None:
            made = self._made[tier, stored_size, codec] = PlainCopy(tier, stored_size, codec)
        return made


#: makes a plain copy's record at most once, whichever thread asks first (``Copies._record``)
_MAKING_RECORDS = threading.Lock()


class Copies:
    """An entry's copies: tier index -> ``BlockRecord``, with the part of a dict's interface the
    store uses (``[t]``, ``in``, ``get``, ``del``, ``items``, ``len``, iteration in tier
    order). Why not a dict: an index of millions of blocks holds one per block, and a dict with
    one item takes 224 bytes; this is one slot of the entry itself (``Entry`` is a ``Copies``:
    a separate object would take 40 bytes more per block). The copies are one value, replaced
    whole on each change, so a reader that does not hold the store lock still sees one consistent
    state: None (no copy), the record of the one copy (its tier is ``record.tier``), a
    ``PlainCopy`` (the one copy of a block put raw into a memory tier or found by a warm restart,
    its record not made yet), or a flat tuple (tier, record, tier, record, ...) in tier order. A
    plain copy's record is made the first time it is asked for (``get``, ``[t]``, ``first_item``,
    ``items``, a change), kept from then on, and one object for every caller (a caller may compare
    it by identity later); ``sizes_and_codecs``, ``stored`` and ``first_codec`` answer without
    making it."""

    __slots__ = ("_flat",)

    def __init__(self) -> None:
        self._flat: tuple | BlockRecord | PlainCopy | None = None

    def clear(self) -> None:
        """No copy any more (their tiers dropped them)."""
        self._flat = None

    def _record(self, stand_in: PlainCopy) -> BlockRecord:
        """The record ``stand_in`` stands for, made from it and the entry, and kept in its place."""
        assert isinstance(self, Entry), "copies are an entry's"
        with _MAKING_RECORDS:
            if self._flat is stand_in:
                record = BlockRecord.of_keys(self.key, self.parent_key, stand_in.stored_size, self.raw_size,
                                             stand_in.codec)
                record.tier = stand_in.tier
                self._flat = record
                return record
        return self.get(stand_in.tier)   # another thread made it meanwhile

    def hold_plain(self, copy: PlainCopy) -> None:
        """A copy its tier, size and codec describe (its record made only when asked for)."""
        if self._flat is None:
            self._flat = copy
        else:   # found in a second tier: records for both
            self[copy.tier] = BlockRecord.of_keys(self.key, self.parent_key, copy.stored_size, self.raw_size,
                                                  copy.codec)

    def sizes_and_codecs(self) -> list[tuple[int, int, int]]:
        """(tier, stored size, codec) of each copy, in tier order, no record made (a whole
        index's figures: ``Store.stats``, namespace footprints)."""
        flat = self._flat
        if flat is None:
            return []
        if type(flat) is tuple:
            return [(flat[i], flat[i + 1].stored_size, flat[i + 1].codec) for i in range(0, len(flat), 2)]
        return [(flat.tier, flat.stored_size, flat.codec)]

    def stored(self, t: int) -> tuple[int, int] | None:
        """``(stored size, codec)`` of the copy in tier ``t``, or None; no record made."""
        flat = self._flat
        if flat is None:
            return None
        if type(flat) is tuple:
            record = self.get(t)
            return None if record is None else (record.stored_size, record.codec)
        return (flat.stored_size, flat.codec) if flat.tier == t else None

    def first_codec(self) -> tuple[int, int]:
        """``(first(), the codec of that copy)``; no record made. ValueError when there is none."""
        flat = self._flat
        if type(flat) is tuple:
            return flat[0], flat[1].codec
        if flat is None:
            raise ValueError("no copy")
        return flat.tier, flat.codec

    def get(self, t: int, default=None):
        flat = self._flat
        if type(flat) is PlainCopy:
            return self._record(flat) if flat.tier == t else default
        if type(flat) is tuple:
            for i in range(0, len(flat), 2):
                if flat[i] == t:
                    return flat[i + 1]
            return default
        return flat if flat is not None and flat.tier == t else default

    def __getitem__(self, t: int) -> BlockRecord:
        record = self.get(t)
        if record is None:
            raise KeyError(t)
        return record

    def __contains__(self, t: object) -> bool:
        flat = self._flat
        if type(flat) is tuple:
            return t in flat[::2]
        return flat is not None and flat.tier == t

    def _set(self, pairs: list) -> None:
        assert all(type(p[1]) is not PlainCopy for p in pairs), "a stand-in among records"
        if not pairs:
            self._flat = None
        elif len(pairs) == 1 and pairs[0][1].tier in (-1, pairs[0][0]):
            t, record = pairs[0]
            record.tier = t   # set before it is published below
            self._flat = record
        else:
            pairs.sort(key=lambda p: p[0])
            self._flat = tuple(x for p in pairs for x in p)

    def __setitem__(self, t: int, record: BlockRecord) -> None:
        if self._flat is None and record.tier in (-1, t):   # most entries: their first copy
            record.tier = t
            self._flat = record
            return
        self._set([p for p in self.items() if p[0] != t] + [(t, record)])

    def __delitem__(self, t: int) -> None:
        flat = self._flat
        if type(flat) is PlainCopy and flat.tier == t:
            self._flat = None   # no record made for a copy that leaves
        elif t in self:
            self._set([p for p in self.items() if p[0] != t])
        else:
            raise KeyError(t)

    def items(self) -> list[tuple[int, BlockRecord]]:
        flat = self._flat
        if type(flat) is tuple:
            return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
        return [] if flat is None else [(flat.tier, self._record(flat) if type(flat) is PlainCopy else flat)]

    def __iter__(self):
        flat = self._flat
        if flat is None:
            return iter(())
        return iter(flat[::2]) if type(flat) is tuple else iter((flat.tier,))

    def first(self) -> int:
        """The fastest tier holding a copy (``min`` of the tiers: the one copy's, or the front of
        the tier-ordered tuple). ValueError when there is none."""
        flat = self._flat
        if type(flat) is tuple:
            return flat[0]
        if flat is None:
            raise ValueError("no copy")
        return flat.tier

    def first_or(self, default: int) -> int:
        """``first()``, or ``default`` when there is no copy (one call on the chain walks' hot path)."""
        flat = self._flat
        if flat is None:
            return default
        return flat[0] if type(flat) is tuple else flat.tier

    def first_item(self) -> tuple[int, BlockRecord]:
        """``(first(), its record)``: the fastest copy."""
        flat = self._flat
        if type(flat) is tuple:
            return flat[0], flat[1]
        if flat is None:
            raise ValueError("no copy")
        return flat.tier, self._record(flat) if type(flat) is PlainCopy else flat

    def __len__(self) -> int:
        flat = self._flat
        return 0 if flat is None else len(flat) // 2 if type(flat) is tuple else 1

    def _shown(self) -> dict | PlainCopy:
        flat = self._flat
        return flat if type(flat) is PlainCopy else dict(self.items())

    def __repr__(self) -> str:
        return f"Copies({self._shown()!r})"


_READY, _DOOMED, _LINKED, _HELD, _WRITING_DOWN, _CHARGED, _LEASED = 1, 2, 4, 8, 16, 32, 64
#: an entry's pins count in its ``_flags`` above the flag bits, in units of ``_PIN``
_PIN = 128
#: an ``Entry``'s ``state`` when made: visible to lookups and gets; its bytes charged to its tenant
READY, CHARGED = _READY, _CHARGED


def _flag(bit: int, doc: str) -> property:
    def get(self) -> bool:
        return bool(self._flags & bit)

    def put(self, on: bool) -> None:
        self._flags = self._flags | bit if on else self._flags & ~bit
    return property(get, put, doc=doc)


class Entry(Copies, NamedByKey):
    """The index's view of one block: where its copies are and who holds it. Slotted, its seven
    flags and its pins in one int, its names held as keys (``key``; its parent's, ``parent_key``:
    the parent entry's ``key`` itself where the parent was indexed first, see
    ``BlockIndex.shared_parent_key``), ``namespace_id`` and ``block_hash`` cut from ``key`` when
    asked, and its copies held in itself (``copies`` is the entry, as a ``Copies``): an index of
    millions holds one per block. ``slot`` is where the store's slot tier keeps this block
    (``SlotTable.keep_slots_in``: the index's dict slot serves that table too), None where it
    does not. The end of a lookup lease is kept beside the index (``BlockIndex.lease``), the entry
    flagged ``leased``. An entry is always true; ``len(entry.copies)`` counts its copies."""

    __slots__ = ("key", "parent_key", "raw_size", "children", "slot", "_flags")

    def __init__(self, key: bytes, parent_key: bytes | None, raw_size: int, state: int = 0,
                 copy: PlainCopy | None = None) -> None:
        """``state``: ``READY`` and/or ``CHARGED``, or 0; ``copy``: its one copy, where a
        ``PlainCopy`` describes it (``hold_plain``). Positional: a put makes one per block, and
        keyword arguments make each call slower."""
        assert len(key) > NAMESPACE_ID_BYTES, "a key is a namespace id and a block hash (block_key)"
        self.key = key
        self.parent_key = parent_key
        self.raw_size = raw_size
        self._flat = copy             # its copies: tier index -> record (``Copies``)
        #: visible children (see BlockIndex.show_run): () none, one's key, a tuple of keys, or a set of many
        self.children: tuple[bytes, ...] | bytes | set[bytes] = ()
        self.slot = None              # kept by the slot tier (``SlotTable``)
        self._flags = state

    @property
    def copies(self) -> Copies:
        """Tier index -> the record of its copy there (the entry itself: see ``Copies``)."""
        return self

    def __bool__(self) -> bool:
        return True

    @property
    def pins(self) -> int:
        """Explicit pins (in-flight reads, leases): changed only through the cascade (``pin_all``,
        ``pin_fastest``, ``unpin_all``), which the index serves (``add_pin``, ``pin_fastest``, ``drop_pins``)."""
        return self._flags // _PIN

    def add_pin(self) -> None:
        """One more pin (``Cascade.pin_entry``): the count above the flag bits, one addition."""
        self._flags += _PIN

    ready = _flag(_READY, "visible to lookups and gets")
    doomed = _flag(_DOOMED, "deleted while pinned: freed on last unpin")
    linked = _flag(_LINKED, "listed in its parent's ``children``")
    held = _flag(_HELD, "in a pinned prefix (``kvstore pin``, pinned_prefixes.py): never evicted")
    writing_down = _flag(_WRITING_DOWN, "its demotion's disk write runs outside the lock (``Transfers.clear_room``)")
    charged = _flag(_CHARGED, "its raw bytes count against its tenant's quota (``TenantQuotas.release_block``)")
    leased = _flag(_LEASED, "given a lookup lease (``BlockIndex.lease``), maybe ended since")

    @property
    def fastest(self) -> int:
        return self.first()

    def stays(self) -> bool:
        """No policy may evict it whatever the time: pinned, in a pinned prefix, or not yet
        written (a lookup lease also keeps it while it lasts: ``BlockIndex.leased``)."""
        flags = self._flags
        return flags >= _PIN or (flags & _HELD) != 0 or not flags & _READY

    @property
    def visible(self) -> bool:
        """Served to lookups and gets: written, and not deleted."""
        return self._flags & (_READY | _DOOMED) == _READY

    def child_keys(self) -> tuple[bytes, ...] | set[bytes]:
        kids = self.children
        return (kids,) if type(kids) is bytes else kids

    def __repr__(self) -> str:
        return (f"Entry({self.key.hex()[:24]}..., copies={self._shown()!r}, ready={self.ready}, pins={self.pins}, "
                f"doomed={self.doomed})")


#: ``first_or``'s answer for an entry without a copy: slower than any tier
_NO_TIER = 1 << 30

#: children a block keeps in a tuple; more go into a set (adding to a tuple copies it)
SMALL_FAMILY = 8


def _add_child(parent: Entry, key: bytes) -> None:
    """Most blocks have 0 or 1 children: the one child's key itself (no container), a tuple of a
    few (48 bytes and up) where a set costs 216."""
    kids = parent.children
    if type(kids) is set:
        kids.add(key)
    elif not kids:
        parent.children = key
    else:
        kids = parent.child_keys() + (key,)
        parent.children = set(kids) if len(kids) > SMALL_FAMILY else kids


class FastestCopies(NamedTuple):
    """The blocks of a batch ``BlockIndex.pin_fastest`` pinned, as parallel lists (no object per
    block): each one's position in the batch, its entry, and its fastest copy's tier and codec."""

    at: list[int]
    entries: list[Entry]
    tiers: list[int]
    codecs: list[int]


class BlockIndex:
    """Entries by key, the bytes of visible blocks per namespace, one policy per tier, and the
    lookup leases.

    A lookup lease keeps a block from eviction for seconds after a lookup reported it, so the get
    that follows finds it. Few blocks hold one at a time (a lookup's, for ``lease_seconds``)
    where the index holds every block, so the ends of leases are kept in a dict beside the entries
    (``_lease_ends``), an entry holding only a flag (``Entry.leased``). Ended leases leave the
    dict in a sweep once it has doubled since the last one (each costs a constant share of the
    sweeps), or with their entry."""

    #: ``_lease_ends`` is swept once it holds this many more than twice what the last sweep left
    LEASE_SWEEP_MIN = 1024

    def __init__(self, policies: list[EvictionPolicy]) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.policies = policies
        self._chains = any(p.uses_chains for p in policies)   # else no policy is told chain states
        self.namespace_bytes: dict[bytes, int] = defaultdict(int)
        self._lease_ends: dict[bytes, float] = {}   # key -> the end of its lookup lease
        self._leases_swept = 0                      # leases left by the last sweep

    # -- lookup leases ---------------------------------------------------------------------------

    def lease(self, entries, until: float, now: float) -> None:
        """Keep each of ``entries`` from eviction until ``until`` (or a later end it has already)."""
        ends = self._lease_ends
        get = ends.get
        for entry in entries:
            if get(entry.key, 0.0) < until:
                ends[entry.key] = until
            entry._flags |= _LEASED
        if len(ends) > 2 * self._leases_swept + self.LEASE_SWEEP_MIN:
            self._sweep_leases(now)

    def _sweep_leases(self, now: float) -> None:
        ends, entries = self._lease_ends, self.entries
        for key, until in list(ends.items()):
            if until <= now:
                del ends[key]
                entry = entries.get(key)
                if entry is not None:
                    entry.leased = False
        self._leases_swept = len(ends)

    def leased(self, entry: Entry, now: float) -> bool:
        """Whether ``entry``'s lookup lease lasts at ``now``."""
        return entry._flags & _LEASED != 0 and self._lease_ends.get(entry.key, 0.0) > now

    def lease_count(self) -> int:
        """Leases kept (those ended since the last sweep among them)."""
        return len(self._lease_ends)

    def forget_lease(self, entry: Entry) -> None:
        """``entry`` leaves the index: its lease with it."""
        if entry.leased:
            self._lease_ends.pop(entry.key, None)
            entry.leased = False

    def find(self, namespace_id: bytes, block_hash: bytes) -> Entry | None:
        return self.entries.get(block_key(namespace_id, block_hash))

    def visible(self, namespace_id: bytes, block_hash: bytes) -> Entry | None:
        entry = self.find(namespace_id, block_hash)
        return entry if entry is not None and entry.visible else None

    def held_blocks(self) -> dict[bytes, list[bytes]]:
        """Every visible block's hash, by namespace."""
        held: dict[bytes, list[bytes]] = defaultdict(list)
        for entry in self.entries.values():
            if entry.visible:
                held[entry.namespace_id].append(entry.block_hash)
        return dict(held)

    # -- chain links -----------------------------------------------------------------------------

    def parent(self, entry: Entry) -> Entry | None:
        return None if entry.parent_key is None else self.entries.get(entry.parent_key)

    def shared_parent_key(self, record: BlockRecord) -> bytes | None:
        """``record.parent_key``, made the parent entry's own ``key`` where the parent is indexed
        (one object for both: an index of millions holds one per block), and that key returned."""
        parent = None if record.parent_key is None else self.entries.get(record.parent_key)
        if parent is not None:
            record.parent_key = parent.key
        return record.parent_key

    def pin_fastest(self, namespace_id: bytes, hashes: Sequence[bytes], todo: Sequence[int]) -> FastestCopies:
        """Pin each visible block of ``hashes[i]`` for ``i`` in ``todo`` and say where its fastest
        copy is (``Cascade.pin_fastest``): ``visible``, ``add_pin`` and ``first_codec`` inlined,
        one loop for a whole batch (a get's plan). Caller holds the lock."""
        get = self.entries.get
        found = FastestCopies([], [], [], [])
        at, pinned, tiers, codecs = found
        for i in todo:
            entry = get(namespace_id + hashes[i])
            if entry is None or entry._flags & (_READY | _DOOMED) != _READY:
                continue
            flat = entry._flat
            t, codec = (flat.tier, flat.codec) if type(flat) is PlainCopy else entry.first_codec()
            entry._flags += _PIN
            at.append(i)
            pinned.append(entry)
            tiers.append(t)
            codecs.append(codec)
        return found

    @staticmethod
    def drop_pins(entries) -> list[Entry]:
        """One pin fewer on each of ``entries`` (``Cascade.unpin_all``); returns those now unpinned
        and doomed (to be freed)."""
        freed = []
        for entry in entries:
            flags = entry._flags - _PIN
            assert flags >= 0, "a negative pin count"
            entry._flags = flags
            if flags < _PIN and flags & _DOOMED:
                freed.append(entry)
        return freed

    def show_run(self, entries) -> int:
        """Make written entries visible, in order, each in its fastest tier: each is listed in its
        parent's ``children`` (a parent with children is not a leaf), then each tier's policy
        learns of its run at once (``insert_run``), with each entry's chain state where it uses
        chains. Linking the whole run first tells a parent in the run its final chain state once,
        not a leaf's and then a parent's; a parent already visible is told its new one after.
        Returns the entries' raw bytes; the namespaces' bytes are counted. A put's usual run (a
        chain into one tier) is shown by ``_show_chain``, to the same effect."""
        shown = self._show_chain(entries)
        if shown is not None:
            return shown
        index, namespace_bytes, chains = self.entries, self.namespace_bytes, self._chains
        visible_parents = []
        nbytes = 0
        for entry in entries:
            flags = entry._flags
            parent = None if entry.parent_key is None else index.get(entry.parent_key)
            if parent is not None and not flags & _LINKED:
                entry._flags = flags | _LINKED
                _add_child(parent, entry.key)
                if chains and parent._flags & _READY:   # (an entry of the run is not, yet)
                    visible_parents.append(parent)
        tiers = [entry.first() for entry in entries]
        states = [self.chain_state(entry, t) for entry, t in zip(entries, tiers)] if chains else None
        new_keys: list[list[bytes]] = [[] for _ in self.policies]
        new_states: list[list[tuple[int, bool]]] = [[] for _ in self.policies]
        for k, entry in enumerate(entries):
            t = tiers[k]
            new_keys[t].append(entry.key)
            if states is not None:
                new_states[t].append(states[k])
            entry._flags |= _READY
            namespace_bytes[entry.key[:NAMESPACE_ID_BYTES]] += entry.raw_size
            nbytes += entry.raw_size
        for t, keys in enumerate(new_keys):
            if keys:
                policy = self.policies[t]
                policy.insert_run(keys, new_states[t] if policy.uses_chains else None)
        for parent in visible_parents:
            self.refresh_policies(parent)
        return nbytes

    def _show_chain(self, entries) -> int | None:
        """``show_run`` for a put's usual run, in one pass, where it applies: at least three entries,
        each in the index, none linked or with a child yet, each but the first the child of the one
        before it, and all holding their one copy as the same ``PlainCopy`` (``Cascade.reserve_run``:
        raw, in one tier). Linked, each but the last then has one child in that tier (the next) and
        each but the first its prefix there: (1, False) without a walk; the first and the last go
        through ``chain_state``. A block's parent is of its namespace, so the run is of one. None
        where it does not apply (nothing changed: ``show_run`` shows the run)."""
        if len(entries) < 3:
            return None
        index, first = self.entries, entries[0]
        copy = first._flat
        before = None
        for entry in entries:
            if (entry._flat is not copy or entry._flags & _LINKED or entry.children
                    or index.get(entry.key) is not entry or before is not None and entry.parent_key is not before.key):
                return None
            before = entry
        if type(copy) is not PlainCopy:
            return None
        parent = None if first.parent_key is None else index.get(first.parent_key)
        refresh = parent is not None and parent._flags & _READY   # a visible parent: told its new state after
        if parent is not None:
            first._flags |= _LINKED
            _add_child(parent, first.key)
        first._flags |= _READY
        nbytes = first.raw_size
        for before, entry in zip(entries, entries[1:]):
            before.children = entry.key
            entry._flags |= _LINKED | _READY
            nbytes += entry.raw_size
        t, last = copy.tier, entries[-1]
        policy = self.policies[t]
        if policy.uses_chains:
            states = [(1, False)] * len(entries)
            states[0], states[-1] = self.chain_state(first, t), self.chain_state(last, t)
            policy.insert_run([entry.key for entry in entries], states)
        else:
            policy.insert_run([entry.key for entry in entries])
        self.namespace_bytes[first.key[:NAMESPACE_ID_BYTES]] += nbytes
        if refresh:
            self.refresh_policies(parent)
        return nbytes

    def link_recovered(self) -> None:
        """List every entry in its parent's ``children`` at once, before any policy knows of them
        (warm restart: ``track_recovered`` then tells the policies each final chain state)."""
        entries = self.entries
        for entry in entries.values():
            if entry.parent_key is None or entry.linked:
                continue
            parent = entries.get(entry.parent_key)
            if parent is None:
                continue
            entry.linked = True
            _add_child(parent, entry.key)

    def track_recovered(self) -> None:
        """``track_copy`` for every copy of every entry, in index order, handed to each policy at
        once (``EvictionPolicy.insert_many``; a policy that ignores chains gets the keys alone)."""
        for t, policy in enumerate(self.policies):
            held = [e for e in self.entries.values() if t in e]   # (an entry is its copies)
            chains = [self.chain_state(e, t) for e in held] if policy.uses_chains else None
            policy.insert_many([e.key for e in held], chains)

    def _unlink(self, entry: Entry) -> Entry | None:
        """Take ``entry`` out of its parent's ``children``; the parent, if it was listed there."""
        parent = self.parent(entry)
        linked = entry._flags & _LINKED
        entry._flags &= ~_LINKED
        if not linked or parent is None:
            return None
        kids = parent.children
        if type(kids) is set:
            kids.discard(entry.key)
        else:
            left = tuple(k for k in parent.child_keys() if k != entry.key)
            parent.children = left[0] if len(left) == 1 else left
        return parent

    def forget_many(self, entries: Sequence[Entry]) -> list[Entry]:
        """Take ``entries`` (their copies dropped) out of the index together, and tell the chain
        policies the state of each neighbour that stays once (a parent lost a child, a child its
        prefix): only the final states count to a policy. One no longer indexed is skipped.
        Returns those that were visible (the caller announces them removed)."""
        index, shown, neighbours = self.entries, [], {}
        namespace_bytes = self.namespace_bytes
        for entry in entries:
            if index.get(entry.key) is not entry:
                continue
            parent = self._unlink(entry)
            if self._chains:
                if parent is not None:
                    neighbours[parent.key] = parent
                for child_key in entry.child_keys():
                    child = index.get(child_key)
                    if child is not None:
                        neighbours[child_key] = child
            self.forget_lease(entry)
            del index[entry.key]
            if entry._flags & _READY:
                shown.append(entry)
                namespace_bytes[entry.key[:NAMESPACE_ID_BYTES]] -= entry.raw_size
        for key, entry in neighbours.items():
            if index.get(key) is entry:
                self.refresh_policies(entry)
        return shown

    # -- what the policies see -------------------------------------------------------------------

    def chain_state(self, entry: Entry, t: int) -> tuple[int, bool]:
        """What the prefix-aware policy of tier ``t`` needs: how many children have a copy in tier
        ``t`` or faster, and whether the parent has none there (the prefix is broken in ``t``)."""
        kids = 0
        if entry.children:
            entries = self.entries
            for child_key in entry.child_keys():
                child = entries.get(child_key)
                if child is not None and child.first_or(_NO_TIER) <= t:   # (an entry is its copies)
                    kids += 1
        if entry.parent_key is None:
            return kids, False
        parent = self.entries.get(entry.parent_key)
        return kids, parent is None or parent.first_or(_NO_TIER) > t

    def track_copy(self, entry: Entry, t: int) -> None:
        """Tell tier ``t``'s policy about the copy ``entry`` now has there (its chain state only
        to a policy that uses it: working it out is most of the cost)."""
        policy = self.policies[t]
        if policy.uses_chains:
            policy.insert(entry.key, *self.chain_state(entry, t))
        else:
            policy.insert(entry.key)

    def refresh_policies(self, entry: Entry) -> None:
        """Tell the policies of ``entry``'s tiers that use chains its chain state now."""
        if not self._chains:
            return
        for t in entry:   # the tiers of its copies
            policy = self.policies[t]
            if policy.uses_chains:
                policy.update(entry.key, *self.chain_state(entry, t))

    def leaving(self, entry: Entry, t: int) -> None:
        """Tell tier ``t``'s policy, if it uses chains, the chain states of ``entry``'s parent and
        children as they will be once its copy in ``t`` is gone (``entry`` is a victim being
        written down, marked ``writing_down``): its policy then names the next victim as it would
        after that eviction (the parent, once a leaf), so a batch of victims is picked ahead in the
        order one at a time would. ``copies_changed`` tells the true states again."""
        policy = self.policies[t]
        if not policy.uses_chains or entry.first_or(_NO_TIER) != t:
            return   # a copy faster than ``t`` stays: nothing changes as ``t`` sees it
        entries = self.entries
        parent = self.parent(entry)
        if parent is not None and entry.linked and t in parent:
            kids = 0
            for child_key in parent.child_keys():
                child = entries.get(child_key)
                first = _NO_TIER if child is None else child.first_or(_NO_TIER)
                if first <= t and not (first == t and child.writing_down):
                    kids += 1
            policy.update(parent.key, kids, self.chain_state(parent, t)[1])
        for child_key in entry.child_keys():
            child = entries.get(child_key)
            if child is not None and t in child:
                policy.update(child.key, self.chain_state(child, t)[0], True)

    def copies_changed(self, entry: Entry) -> None:
        """``entry`` gained or lost a copy: its parent's children and its children's prefix, as
        each tier sees them, may have changed."""
        parent = self.parent(entry)
        if parent is not None and entry.linked:
            self.refresh_policies(parent)
        for child_key in entry.child_keys():
            child = self.entries.get(child_key)
            if child is not None:
                self.refresh_policies(child)

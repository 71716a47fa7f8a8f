"""The block index: one Entry per block, the prefix-chain links between entries, and what each
tier's eviction policy is told about those links.

The prefix-aware policy wants to know, per tier, how many of a block's children sit in that tier
or a faster one, and whether its parent is missing there (a broken prefix). Both change whenever
a block gains or loses a copy or a child; every such change goes through this module so the
policies never see a stale chain. Callers hold the store lock.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvstore.keys import block_key
from kvstore.store.policy import EvictionPolicy
from kvstore.tiers.base import BlockRecord


class Copies:
    """An entry's copies: tier index -> ``BlockRecord``, with the part of a dict's interface the
    store uses (``[t]``, ``in``, ``get``, ``pop``, ``del``, ``items``, ``len``, iteration in tier
    order). Why not a dict: an index of millions of blocks holds one per block, and a dict with
    one item takes 224 bytes; this takes 104. The copies are one flat tuple (tier, record, tier,
    record, ...) in tier order, replaced whole on each change, so a reader that does not hold
    the store lock still sees one consistent state."""

    __slots__ = ("_flat",)

    def __init__(self) -> None:
        self._flat: tuple = ()

    def get(self, t: int, default=None):
        flat = self._flat
        for i in range(0, len(flat), 2):
            if flat[i] == t:
                return flat[i + 1]
        return default

    def __getitem__(self, t: int) -> BlockRecord:
        record = self.get(t)
        if record is None:
            raise KeyError(t)
        return record

    def __contains__(self, t: object) -> bool:
        flat = self._flat
        return flat[0] == t if len(flat) == 2 else t in flat[::2]

    def __setitem__(self, t: int, record: BlockRecord) -> None:
        if not self._flat:   # most entries: their first copy
            self._flat = (t, record)
            return
        pairs = [p for p in self.items() if p[0] != t] + [(t, record)]
        pairs.sort(key=lambda p: p[0])
        self._flat = tuple(x for p in pairs for x in p)

    def pop(self, t: int, *default):
        record = self.get(t)
        if record is None:
            if default:
                return default[0]
            raise KeyError(t)
        flat = self._flat
        self._flat = tuple(x for i in range(0, len(flat), 2) if flat[i] != t for x in flat[i:i + 2])
        return record

    def __delitem__(self, t: int) -> None:
        self.pop(t)

    def items(self) -> list[tuple[int, BlockRecord]]:
        flat = self._flat
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]

    def __iter__(self):
        return iter(self._flat[::2])

    def __len__(self) -> int:
        return len(self._flat) // 2

    def __repr__(self) -> str:
        return f"Copies({dict(self.items())!r})"


@dataclasses.dataclass(slots=True)
class Entry:
    """The index's view of one block: where its copies are and who holds it. Slotted, with its
    key made once: hot paths read ``key`` several times per block."""

    namespace_id: bytes
    block_hash: bytes
    parent_hash: bytes | None
    raw_size: int
    copies: Copies = dataclasses.field(default_factory=Copies)  # tier index -> record
    ready: bool = False          # visible to lookups and gets
    pins: int = 0                # explicit pins (in-flight reads, leases)
    pinned_until: float = 0.0    # lookup lease
    doomed: bool = False         # deleted while pinned: freed on last unpin
    children: tuple[bytes, ...] | set[bytes] = ()   # keys of visible children (see BlockIndex.link)
    linked: bool = False         # listed in its parent's ``children``
    charged_to: str | None = None  # the tenant whose quota counts this block (see quotas.py)
    held: bool = False           # in a pinned prefix (``kvstore pin``, pinned_prefixes.py): never evicted
    writing_down: bool = False   # its demotion's disk write runs outside the lock (``Cascade.clear_room``)
    key: bytes = dataclasses.field(init=False, repr=False, compare=False)   # block_key(namespace, hash)

    def __post_init__(self) -> None:
        self.key = block_key(self.namespace_id, self.block_hash)

    @property
    def fastest(self) -> int:
        return min(self.copies)

    @property
    def visible(self) -> bool:
        """Served to lookups and gets: written, and not deleted."""
        return self.ready and not self.doomed


#: children a block keeps in a tuple; more go into a set (adding to a tuple copies it)
SMALL_FAMILY = 8


class BlockIndex:
    """Entries by key, the bytes of visible blocks per namespace, and one policy per tier."""

    def __init__(self, policies: list[EvictionPolicy]) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.policies = policies
        self.namespace_bytes: dict[bytes, int] = defaultdict(int)

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
        if entry.parent_hash is None:
            return None
        return self.entries.get(entry.namespace_id + entry.parent_hash)   # block_key, inlined: hot

    def link(self, entry: Entry) -> None:
        """List a newly visible block in its parent (a parent with children is not a leaf)."""
        parent = self.parent(entry)
        if parent is not None and not entry.linked:
            entry.linked = True
            kids = parent.children
            if isinstance(kids, set):
                kids.add(entry.key)
            else:   # most blocks have 0 or 1 children: a tuple (48 bytes) where a set costs 216
                kids += (entry.key,)
                parent.children = set(kids) if len(kids) > SMALL_FAMILY else kids
            self.refresh_policies(parent)

    def link_recovered(self) -> None:
        """``link`` every entry into its parent at once, before any policy knows of them (warm
        restart: ``track_recovered`` then tells the policies each final chain state)."""
        entries = self.entries
        for entry in entries.values():
            if entry.parent_hash is None or entry.linked:
                continue
            parent = entries.get(entry.namespace_id + entry.parent_hash)
            if parent is None:
                continue
            entry.linked = True
            kids = parent.children
            if isinstance(kids, set):
                kids.add(entry.key)
            else:
                kids += (entry.key,)
                parent.children = set(kids) if len(kids) > SMALL_FAMILY else kids

    def track_recovered(self) -> None:
        """``track_copy`` for every copy of every entry, in index order; a policy that ignores
        chains is handed the keys alone (``EvictionPolicy.insert_many``)."""
        for t, policy in enumerate(self.policies):
            held = (e for e in self.entries.values() if t in e.copies)
            if policy.uses_chains:
                for entry in held:
                    policy.insert(entry.key, *self.chain_state(entry, t))
            else:
                policy.insert_many(e.key for e in held)

    def unlink(self, entry: Entry) -> None:
        parent = self.parent(entry)
        if entry.linked and parent is not None:
            kids = parent.children
            if isinstance(kids, set):
                kids.discard(entry.key)
            else:
                parent.children = tuple(k for k in kids if k != entry.key)
            self.refresh_policies(parent)
        entry.linked = False

    # -- what the policies see -------------------------------------------------------------------

    def chain_state(self, entry: Entry, t: int) -> tuple[int, bool]:
        """What the prefix-aware policy of tier ``t`` needs: how many children have a copy in tier
        ``t`` or faster, and whether the parent has none there (the prefix is broken in ``t``)."""
        kids = 0
        if entry.children:
            entries = self.entries
            for child_key in entry.children:
                child = entries.get(child_key)
                if child is not None and child.copies and min(child.copies) <= t:
                    kids += 1
        if entry.parent_hash is None:
            return kids, False
        parent = self.entries.get(entry.namespace_id + entry.parent_hash)
        return kids, parent is None or not parent.copies or min(parent.copies) > t

    def track_copy(self, entry: Entry, t: int) -> None:
        """Tell tier ``t``'s policy about the copy ``entry`` now has there."""
        self.policies[t].insert(entry.key, *self.chain_state(entry, t))

    def refresh_policies(self, entry: Entry) -> None:
        for t in entry.copies:
            self.policies[t].update(entry.key, *self.chain_state(entry, t))

    def copies_changed(self, entry: Entry) -> None:
        """``entry`` gained or lost a copy: its parent's children and its children's prefix, as
        each tier sees them, may have changed."""
        parent = self.parent(entry)
        if parent is not None and entry.linked:
            self.refresh_policies(parent)
        for child_key in entry.children:
            child = self.entries.get(child_key)
            if child is not None:
                self.refresh_policies(child)

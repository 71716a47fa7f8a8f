"""Eviction policies: which block a full tier gives up first. Metadata only, never payloads.

One policy instance tracks the keys of one tier. The Store calls ``insert`` / ``touch`` /
``remove`` as blocks arrive, are read and leave, and ``pick_victim`` when it needs room; a victim
is only a suggestion until the Store removes it. Pinned blocks (under a lease) are skipped.
Because policies see only keys, the sizing planner replays exactly this code.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

IsPinned = Callable[[bytes], bool]


class EvictionPolicy(ABC):
    """Recency bookkeeping for the keys of one tier.

    The Store also reports each key's place in its chain *as seen from this tier*
    (``update(key, children, orphan)``): ``children`` = children that have a copy in this tier or
    a faster one, ``orphan`` = its parent has no copy in this tier or a faster one (the prefix
    above it is broken here). Policies that ignore structure ignore both.
    """

    name: str

    @abstractmethod
    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None: ...

    @abstractmethod
    def touch(self, key: bytes) -> None: ...

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    def update(self, key: bytes, children: int, orphan: bool) -> None:
        pass

    @abstractmethod
    def pick_victim(self, is_pinned: IsPinned) -> bytes | None: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None:
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        for key in self._order:
            if not is_pinned(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class PrefixAwarePolicy(EvictionPolicy):
    """A chain is given up from its tail, so the shared head stays in the fast tier.

    Victims, each class least recently used first:
      1. orphans that are leaves here: their prefix already left this tier, so a prefix lookup
         cannot stream them from here anyway (the tail of a chain that outgrew the tier);
      2. leaves here: blocks with no child in this tier or a faster one;
      3. anything unpinned (only when every leaf is pinned).
    """

    name = "prefix"

    def __init__(self) -> None:
        self._lru = LRUPolicy()
        self._children: dict[bytes, int] = {}
        self._orphan: dict[bytes, bool] = {}
        self._tick: dict[bytes, int] = {}
        self._clock = itertools.count()
        # heaps of (tick, key); stale entries (old tick, or no longer in that class) skipped lazily
        self._leaves: list[tuple[int, bytes]] = []
        self._orphans: list[tuple[int, bytes]] = []

    def _is_leaf(self, key: bytes) -> bool:
        return self._children.get(key) == 0

    def _is_orphan_leaf(self, key: bytes) -> bool:
        return self._children.get(key) == 0 and self._orphan.get(key, False)

    def _push(self, key: bytes) -> None:
        if not self._is_leaf(key):
            return
        heap = self._orphans if self._orphan[key] else self._leaves
        heapq.heappush(heap, (self._tick[key], key))
        if len(heap) > 4 * len(self._tick) + 64:
            self._leaves = [(t, k) for t, k in self._leaves if self._tick.get(k) == t and self._is_leaf(k)]
            self._orphans = [(t, k) for t, k in self._orphans
                             if self._tick.get(k) == t and self._is_orphan_leaf(k)]
            heapq.heapify(self._leaves)
            heapq.heapify(self._orphans)

    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None:
        self._lru.insert(key)
        self._tick[key] = next(self._clock)
        self._children[key] = children
        self._orphan[key] = orphan
        self._push(key)

    def touch(self, key: bytes) -> None:
        self._lru.touch(key)
        self._tick[key] = next(self._clock)
        self._push(key)

    def remove(self, key: bytes) -> None:
        if self._tick.pop(key, None) is not None:
            self._lru.remove(key)
            del self._children[key]
            del self._orphan[key]

    def update(self, key: bytes, children: int, orphan: bool) -> None:
        if key not in self._tick:
            return
        changed = (self._children[key], self._orphan[key]) != (children, orphan)
        self._children[key] = children
        self._orphan[key] = orphan
        if changed:
            self._push(key)

    def _pick(self, heap: list[tuple[int, bytes]], valid, is_pinned: IsPinned) -> bytes | None:
        skipped, victim = [], None
        while heap:
            tick, key = heapq.heappop(heap)
            if self._tick.get(key) != tick or not valid(key):
                continue
            skipped.append((tick, key))
            if not is_pinned(key):
                victim = key
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return victim

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        return (self._pick(self._orphans, self._is_orphan_leaf, is_pinned)
                or self._pick(self._leaves, self._is_leaf, is_pinned)
                or self._lru.pick_victim(is_pinned))

    def __len__(self) -> int:
        return len(self._tick)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "prefix": PrefixAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction_policy: unknown {name!r}; one of {sorted(POLICIES)}") from None

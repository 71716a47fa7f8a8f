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

    ``children`` counts a block's children stored anywhere in the store (the Store keeps it
    current through ``child_added`` / ``child_removed``); policies that ignore structure ignore it.
    """

    name: str

    @abstractmethod
    def insert(self, key: bytes, children: int = 0) -> None: ...

    @abstractmethod
    def touch(self, key: bytes) -> None: ...

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    def child_added(self, key: bytes) -> None:
        pass

    def child_removed(self, key: bytes) -> None:
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

    def insert(self, key: bytes, children: int = 0) -> None:
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
    """Least recently used *leaf* first: a child is useless without its prefix, so a chain is
    given up from its tail and the shared head stays in the fast tier. A leaf is a block with no
    child stored anywhere. Falls back to plain LRU only when every leaf is pinned."""

    name = "prefix"

    def __init__(self) -> None:
        self._lru = LRUPolicy()
        self._children: dict[bytes, int] = {}
        self._tick: dict[bytes, int] = {}
        self._clock = itertools.count()
        self._leaves: list[tuple[int, bytes]] = []  # heap of (tick, key); stale entries skipped lazily

    def _push_leaf(self, key: bytes) -> None:
        heapq.heappush(self._leaves, (self._tick[key], key))
        if len(self._leaves) > 4 * len(self._tick) + 64:
            self._leaves = [(t, k) for t, k in self._leaves if self._is_live_leaf(t, k)]
            heapq.heapify(self._leaves)

    def _is_live_leaf(self, tick: int, key: bytes) -> bool:
        return self._tick.get(key) == tick and self._children.get(key) == 0

    def insert(self, key: bytes, children: int = 0) -> None:
        self._lru.insert(key)
        self._tick[key] = next(self._clock)
        self._children[key] = children
        if children == 0:
            self._push_leaf(key)

    def touch(self, key: bytes) -> None:
        self._lru.touch(key)
        self._tick[key] = next(self._clock)
        if self._children[key] == 0:
            self._push_leaf(key)

    def remove(self, key: bytes) -> None:
        if self._tick.pop(key, None) is not None:
            self._lru.remove(key)
            del self._children[key]

    def child_added(self, key: bytes) -> None:
        if key in self._children:
            self._children[key] += 1

    def child_removed(self, key: bytes) -> None:
        if key in self._children:
            self._children[key] -= 1
            if self._children[key] == 0:
                self._push_leaf(key)

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        skipped = []
        victim = None
        while self._leaves:
            tick, key = heapq.heappop(self._leaves)
            if not self._is_live_leaf(tick, key):
                continue
            skipped.append((tick, key))
            if not is_pinned(key):
                victim = key
                break
        for entry in skipped:
            heapq.heappush(self._leaves, entry)
        return victim if victim is not None else self._lru.pick_victim(is_pinned)

    def __len__(self) -> int:
        return len(self._tick)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "prefix": PrefixAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction_policy: unknown {name!r}; one of {sorted(POLICIES)}") from None

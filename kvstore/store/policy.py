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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

IsPinned = Callable[[bytes], bool]
#: a prefix-aware policy's class bits of a key (``PrefixAwarePolicy``)
_ORPHAN, _LEAF = 1, 2
_CLASS = _ORPHAN | _LEAF


class EvictionPolicy(ABC):
    """Recency bookkeeping for the keys of one tier.

    The Store also reports each key's place in its chain *as seen from this tier*
    (``update(key, children, orphan)``): ``children`` = children that have a copy in this tier or
    a faster one, ``orphan`` = its parent has no copy in this tier or a faster one (the prefix
    above it is broken here). Policies that ignore structure ignore both.
    """

    name: str
    #: whether ``insert``/``update`` use ``children`` and ``orphan`` (else callers may skip working them out)
    uses_chains = False
    #: whether the victims it names before new keys arrive are those it would name as each
    #: arrives (new keys are never its next victims while older ones are unpinned): a put may
    #: then make room for many blocks at once
    picks_ahead = False

    @abstractmethod
    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None: ...

    def insert_many(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        """``insert`` each key, in order, with its (children, orphan) from ``chains`` (None: without
        a chain state, for policies that ignore it)."""
        self._insert_each(keys, chains)

    def insert_run(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        """``insert`` each key, in order, with its (children, orphan) from ``chains`` (None: without
        a chain state): a run of new blocks, as new as any insert, unlike ``insert_many``'s bulk
        (which a policy may keep apart: a warm restart's keys)."""
        self._insert_each(keys, chains)

    def _insert_each(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None) -> None:
        if chains is None:
            for key in keys:
                self.insert(key)
        else:
            for key, (children, orphan) in zip(keys, chains):
                self.insert(key, children, orphan)

    @abstractmethod
    def touch(self, key: bytes) -> None: ...

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """``touch`` each key, in order (a batch of reads)."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    def remove_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.remove(key)

    def update(self, key: bytes, children: int, orphan: bool) -> None:
        pass

    @abstractmethod
    def pick_victim(self, is_pinned: IsPinned) -> bytes | None: ...

    def pick_victims(self, is_pinned: IsPinned, n: int) -> list[bytes]:
        """Up to ``n`` victims, in the order ``pick_victim`` would name them were each pinned once
        named. Only a policy that ``picks_ahead`` names more than one at a time."""
        victim = self.pick_victim(is_pinned)
        return [] if victim is None else [victim]

    @abstractmethod
    def __len__(self) -> int: ...


class DormantKeys:
    """Keys handed to an empty policy in bulk (a warm restart's recovered blocks), oldest first,
    held in a list: 8 bytes a key, where a dict takes about 55 (an index of millions holds one per
    block). A key that leaves (touched, given a new class, removed) stays in the list and goes
    into ``left``; walks skip it, the old end is trimmed as they reach it, and the list is
    compacted once most of it has left. ``left`` is emptied only with the list. A policy asks
    ``holds`` only about a key the store says it holds (and the policy holds no other way): no
    lookup per key can tell a dormant key from one never handed over, so the store's word is
    taken for it (a key it removes without having inserted it only makes ``left`` longer)."""

    #: ``left`` may name this many more keys than half the list before the list is compacted
    COMPACT_MIN = 64

    def __init__(self, keys: Iterable[bytes] = ()) -> None:
        self._keys = list(keys)
        self._keys.reverse()   # oldest last: trimmed from the end
        self._left: set[bytes] = set()

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        left = self._left
        return sum(1 for key in self._keys if key not in left)

    def holds(self, key: bytes) -> bool:
        """Whether ``key``, held by the policy and found nowhere else in it, is still dormant."""
        return bool(self._keys) and key not in self._left

    def leave(self, key: bytes) -> None:
        left = self._left
        left.add(key)
        if len(left) > self.COMPACT_MIN + len(self._keys) // 2:
            self._keys = [k for k in self._keys if k not in left]
            self._emptied()

    def _emptied(self) -> None:
        if not self._keys:
            self._left = set()

    def oldest_first(self) -> Iterator[bytes]:
        """The dormant keys, oldest first (the old end's left keys trimmed first)."""
        keys, left = self._keys, self._left
        while keys and keys[-1] in left:
            keys.pop()
        self._emptied()
        return (key for key in reversed(keys) if key not in left)


class LRUPolicy(EvictionPolicy):
    """Least recently used first.

    One plain dict holds every key but the dormant ones, least recently used first: a key
    touched is taken out and put back at its end, as in ``PrefixAwarePolicy``. A dict has no
    cheap way to its first key once many have left its front, so victims are named from
    ``_queue``, a list of the dict's keys made at the start of a round (8 bytes a key, where an
    ``OrderedDict``'s links take about 50 more), walked from ``_head``. The dict's value for a
    key is the round it was last inserted or touched in (an int shared by the round's keys): a
    key of the queue still held and of an earlier round than the queue's is where the queue
    says, and the keys of the queue's round follow all of them, in the dict's order. A walk that
    passes the queue's end starts the next round with the dict's keys at that moment; walks
    trim the queue's front (keys gone or used since) as they go, so each key costs a constant
    share of the rounds.

    Keys handed over in bulk into an empty policy (``insert_many``: a warm restart's recovered
    blocks) are older than any inserted since: they wait dormant (``DormantKeys``), oldest first.
    Touching one moves it into ``_order``. As the store uses a policy, a key is inserted only
    while not held, and touched only while held.
    """

    name = "lru"
    picks_ahead = True

    def __init__(self) -> None:
        self._order: dict[bytes, int] = {}   # key -> round it was last used in; least recently used first
        self._round = 0
        self._queue: list[bytes] = []        # ``_order``'s keys when ``_round`` began
        self._head = 0                       # ``_queue``'s keys before it left or were used since
        self._dormant = DormantKeys()

    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None:
        self._order.setdefault(key, self._round)

    def insert_many(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        if self._order or self._dormant:
            self.insert_run(keys)
        else:
            self._dormant = DormantKeys(keys)

    def insert_run(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        add, now = self._order.setdefault, self._round
        for key in keys:
            add(key, now)

    def touch(self, key: bytes) -> None:
        order = self._order
        if order.pop(key, None) is None:
            if not self._dormant.holds(key):
                raise KeyError(key)   # not held
            self._dormant.leave(key)
        order[key] = self._round

    def touch_many(self, keys: Iterable[bytes]) -> None:
        order, now = self._order, self._round
        for key in keys:
            if order.pop(key, None) is None:
                self.touch(key)   # dormant (or not held: raises)
            else:
                order[key] = now

    def remove(self, key: bytes) -> None:
        if self._order.pop(key, None) is None and self._dormant.holds(key):   # not in _order: dormant (or not held)
            self._dormant.leave(key)

    def remove_many(self, keys: Iterable[bytes]) -> None:
        pop = self._order.pop
        for key in keys:
            if pop(key, None) is None:
                self.remove(key)

    def _least_recent_first(self) -> Iterator[bytes]:
        """``_order``'s keys, least recently used first (see the class docstring). Only read
        while the caller walks it, but for the queue's front and a new round."""
        order, queue, now = self._order, self._queue, self._round
        head = self._head
        while head < len(queue) and order.get(queue[head], now) >= now:   # left, or used since
            head += 1
        if head > 1024 and head > len(queue) // 2:
            del queue[:head]
            head = 0
        self._head = head
        for i in range(head, len(queue)):
            key = queue[i]
            if order.get(key, now) < now:
                yield key
        # every key of an earlier round is yielded: a new round; its queue starts with them again
        self._queue, self._head, self._round = list(order), 0, now + 1
        for key in self._queue:
            if order[key] >= now:
                yield key

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        return next(iter(self.pick_victims(is_pinned, 1)), None)

    def pick_victims(self, is_pinned: IsPinned, n: int) -> list[bytes]:
        """In one pass: naming them one by one would walk past those already named (pinned) each
        time."""
        return list(itertools.islice((key for key in itertools.chain(self._dormant.oldest_first(),
                                                                     self._least_recent_first())
                                      if not is_pinned(key)), n))

    def __len__(self) -> int:
        return len(self._order) + len(self._dormant)


class PrefixAwarePolicy(EvictionPolicy):
    """A chain is given up from its tail, so the shared head stays in the fast tier.

    Victims, each class least recently used first:
      1. orphans that are leaves here: their prefix already left this tier, so a prefix lookup
         cannot stream them from here anyway (the tail of a chain that outgrew the tier);
      2. leaves here: blocks with no child in this tier or a faster one;
      3. anything unpinned (only when every leaf is pinned).

    Per key one int in one dict (an index of millions holds one per block): its last use (a tick)
    and its class, ``tick << 2 | leaf << 1 | orphan``. That dict is also the recency order class 3
    walks: a key touched is taken out and put back at its end, so it lists keys least recently
    used first, and no second structure per key is needed. The classes' heaps hold (tick, key) of
    leaves, taken in when a victim is searched for (``_flush``: a key given a leaf's state waits in
    ``_pending`` till then, and most are parents by then, with no heap entry); an entry whose key
    has moved on (a newer tick, or no longer a leaf) is skipped lazily.
    Keys handed over in bulk into an empty policy (a warm restart's) wait dormant
    (``DormantKeys``: no int, no dict slot), older than any other, their ticks below
    ``_bulk_end``; a dormant key keeps its class (``_bulk_leaves`` holds the classes of the few
    that were leaves: one per chain), so its heap entry from the bulk is its only one.
    Touched, a key wakes with the newest tick; given a new class, with the bulk's newest (class 3
    then walks it after the keys still dormant). As the store uses a policy, a key is inserted
    only while not held, and touched or updated only while held.
    """

    name = "prefix"
    uses_chains = True
    #: keys given a leaf's state wait in ``_pending`` until a victim is searched for or this many wait
    PENDING_MAX = 1024

    def __init__(self) -> None:
        self._state: dict[bytes, int] = {}   # least recently used first
        self._dormant = DormantKeys()
        self._clock = itertools.count()
        self._bulk_end = 0                   # dormant keys' ticks are below it
        self._bulk_leaves: dict[bytes, int] = {}   # the class of dormant keys that were leaves (few)
        self._leaves: list[tuple[int, bytes]] = []
        self._orphans: list[tuple[int, bytes]] = []
        self._pending: list[bytes] = []   # keys given a leaf's state since ``_flush`` (few)

    def _push(self, key: bytes, state: int) -> None:
        if state & _LEAF:
            self._pending.append(key)
            if len(self._pending) >= self.PENDING_MAX:
                self._flush()

    def _flush(self) -> None:
        """Give each pending key that is still a leaf its (tick, key) in its class's heap. Most
        keys are inserted as leaves and are parents by the next victim search (their child comes
        in the same put): the heaps then never hold an entry for them."""
        pending, self._pending = self._pending, []
        states = self._state
        for key in dict.fromkeys(pending):
            state = states.get(key)   # None: removed since (or dormant: its bulk entry stands)
            if state is not None and state & _LEAF:
                heapq.heappush(self._orphans if state & _ORPHAN else self._leaves, (state >> 2, key))
        if len(self._leaves) + len(self._orphans) > 4 * (len(states) + (self._bulk_end if self._dormant else 0)) + 64:
            self._leaves = [(t, k) for t, k in self._leaves if self._holds(k, t, _LEAF)]
            self._orphans = [(t, k) for t, k in self._orphans if self._holds(k, t, _LEAF | _ORPHAN)]
            heapq.heapify(self._leaves)
            heapq.heapify(self._orphans)

    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None:
        state = self._state[key] = next(self._clock) << 2 | (children == 0) << 1 | bool(orphan)
        self._push(key, state)

    def insert_run(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        """``insert`` each key in order (``insert``'s lines, in one loop: a put's run of blocks)."""
        if chains is None:
            chains = itertools.repeat((0, False))
        states, tick = self._state, next(self._clock)
        for key, (children, orphan) in zip(keys, chains):
            state = states[key] = tick << 2 | (children == 0) << 1 | bool(orphan)
            tick += 1
            if state & _LEAF:
                self._push(key, state)
        self._clock = itertools.count(tick)   # the run's ticks taken at once

    def insert_many(self, keys: Iterable[bytes], chains: Iterable[tuple[int, bool]] | None = None) -> None:
        keys = list(keys)
        if chains is None:
            chains = [(0, False)] * len(keys)
        if self._state or self._dormant:   # not empty: each one as new as any insert
            self.insert_run(keys, chains)
            return
        clock = self._clock
        leaves: list[tuple[int, bytes]] = []
        orphans: list[tuple[int, bytes]] = []
        for key, (children, orphan) in zip(keys, chains):
            tick = next(clock)
            if children == 0:
                (orphans if orphan else leaves).append((tick, key))
        # dormant, in tick order: each list is a heap already
        self._dormant = DormantKeys(keys)
        self._bulk_leaves = {key: _LEAF | _ORPHAN for _, key in orphans} | {key: _LEAF for _, key in leaves}
        self._leaves, self._orphans = leaves, orphans
        self._bulk_end = next(clock)

    def _wake(self, key: bytes) -> int | None:
        """Take ``key`` out of the dormant ones: its class, or None where it is not one."""
        if key in self._state or not self._dormant.holds(key):
            return None
        self._dormant.leave(key)
        return self._bulk_leaves.pop(key, 0)

    def touch(self, key: bytes) -> None:
        woken = self._wake(key)
        state = self._state.pop(key) if woken is None else woken   # KeyError for a key not held
        state = self._state[key] = next(self._clock) << 2 | state & _CLASS   # at the recent end
        self._push(key, state)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """``touch`` each key, in order, in one loop (a batch of reads: small blocks are bound by
        per-block Python): a key awake is moved to the recent end here, a dormant one by ``touch``."""
        states, clock, pending = self._state, self._clock, self._pending
        for key in keys:
            state = states.pop(key, None)
            if state is None:
                self.touch(key)
                pending = self._pending   # (a flush there starts a new list)
                continue
            state = states[key] = next(clock) << 2 | state & _CLASS
            if state & _LEAF:
                pending.append(key)
        if len(pending) >= self.PENDING_MAX:
            self._flush()

    def remove(self, key: bytes) -> None:
        if self._state.pop(key, None) is None:
            self._wake(key)

    def update(self, key: bytes, children: int, orphan: bool) -> None:
        old = self._state.get(key)
        if old is None:
            if self._wake(key) is None:
                return   # not held
            old, tick = -1, self._bulk_end - 1   # woken: its heap entry from the bulk is stale now
        else:
            tick = old >> 2
        state = tick << 2 | (children == 0) << 1 | bool(orphan)
        if state != old:
            self._state[key] = state
            self._push(key, state)

    def _holds(self, key: bytes, tick: int, need: int) -> bool:
        """Whether a heap's (tick, key) is still the key's last use, and the key still of class ``need``."""
        state = self._state.get(key)
        if state is None:   # dormant: its entry from the bulk, of its class then and now
            return tick < self._bulk_end and self._dormant.holds(key)
        return state >> 2 == tick and state & need == need

    def _pick(self, heap: list[tuple[int, bytes]], need: int, is_pinned: IsPinned) -> bytes | None:
        skipped, victim = [], None
        while heap:
            tick, key = heapq.heappop(heap)
            if not self._holds(key, tick, need):
                continue
            skipped.append((tick, key))
            if not is_pinned(key):
                victim = key
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return victim

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        if self._pending:
            self._flush()
        return (self._pick(self._orphans, _LEAF | _ORPHAN, is_pinned)
                or self._pick(self._leaves, _LEAF, is_pinned)
                or next((key for key in itertools.chain(self._dormant.oldest_first(), self._state)
                         if not is_pinned(key)), None))

    def __len__(self) -> int:
        return len(self._state) + len(self._dormant)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

    Most blocks of a KV cache are never read again (a unique question, the tail of a finished
    conversation); LRU lets every such one-hit wonder push out a block that is read again.
    S3-FIFO gives new blocks a short probation instead:

    * ``small``: new blocks, FIFO, about 10% of the tier. A block read while here moves to main
      when it reaches the head; one never read is evicted and its key remembered in ``ghost``.
    * ``main``: FIFO with a 2-bit read counter; the head is reinserted (counter - 1) while its
      counter is non-zero, else evicted.
    * ``ghost``: keys recently evicted from small (no data, bounded to the tier's key count). A
      block inserted again while its key is a ghost was wanted after all: it goes straight to main.

    A pinned block at the head of a queue is in use: it goes to the back of that queue. Only the
    victim the policy named counts as evicted (ghosted) when removed; other removals are deletes.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3            # two bits
    MIN_GHOSTS = 64

    def __init__(self) -> None:
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._named: bytes | None = None

    def insert(self, key: bytes, children: int = 0, orphan: bool = False) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is None:
            return
        evicted = key == self._named
        if evicted:
            self._named = None
        if key in self._small:
            del self._small[key]
            if evicted:   # a ghost now, the oldest ghosts forgotten past the tier's key count
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._freq), self.MIN_GHOSTS):
                    self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def queue_of(self, key: bytes) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or None: where the policy holds ``key`` (for tests
        and debugging)."""
        for name, queue in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in queue:
                return name
        return None

    def pick_victim(self, is_pinned: IsPinned) -> bytes | None:
        if len(self._small) >= self.SMALL_FRACTION * len(self._freq):
            victim = self._from_small(is_pinned) or self._from_main(is_pinned)
        else:
            victim = self._from_main(is_pinned) or self._from_small(is_pinned)
        self._named = victim
        return victim

    def _from_small(self, is_pinned: IsPinned) -> bytes | None:
        for _ in range(len(self._small)):        # each block at the head when we started, once
            key = next(iter(self._small))
            if self._freq[key] > 0:              # read during probation: keep it
                del self._small[key]
                self._main[key] = None
            elif is_pinned(key):
                self._small.move_to_end(key)
            else:
                return key
        return None

    def _from_main(self, is_pinned: IsPinned) -> bytes | None:
        pinned_in_a_row = 0
        while self._main and pinned_in_a_row < len(self._main):
            key = next(iter(self._main))
            if self._freq[key] > 0:              # read since it last came round: another lap
                self._freq[key] -= 1
                pinned_in_a_row = 0
            elif is_pinned(key):
                pinned_in_a_row += 1
            else:
                return key
            self._main.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self._freq)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "prefix": PrefixAwarePolicy, "s3fifo": S3FIFOPolicy}

#: the policy of a tier that a per-tier ``eviction_policy`` mapping does not name
DEFAULT_POLICY = "prefix"


def make_policy(name: str, key: str = "eviction_policy") -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"{key}: unknown {name!r}; one of {sorted(POLICIES)}") from None


def policy_name_for(spec: str | Mapping[str, str], tier: str) -> str:
    """The policy ``spec`` gives tier ``tier``: a plain name applies to every tier; a mapping
    (tier name -> policy) names some tiers, and the others get ``DEFAULT_POLICY``."""
    if isinstance(spec, str):
        return spec
    return spec.get(tier, DEFAULT_POLICY)


def make_tier_policies(spec: str | Mapping[str, str], tier_names: Sequence[str]) -> list[EvictionPolicy]:
    """One policy per tier, in ``tier_names`` order. A mapping may name tiers this store does not
    have (a ``gpu`` entry on a host without a GPU tier): those entries are unused. An unknown
    policy is refused naming its key (``eviction_policy.nvme``)."""
    if not isinstance(spec, (str, Mapping)):
        raise ValueError(f"eviction_policy: a policy name or a mapping of tier -> policy, not {spec!r}")
    if isinstance(spec, Mapping):
        for tier, name in spec.items():
            make_policy(name, f"eviction_policy.{tier}")   # refuses an unknown one, named by its key
    return [make_policy(policy_name_for(spec, t), "eviction_policy" if isinstance(spec, str)
                        else f"eviction_policy.{t}") for t in tier_names]

"""Eviction policies on metadata alone: LRU order, prefix-aware leaf-first, S3-FIFO probation, pinned
blocks skipped."""

from __future__ import annotations

import pytest

from kvstore.store.policy import LRUPolicy, PrefixAwarePolicy, S3FIFOPolicy, make_policy


def never_pinned(_key: bytes) -> bool:
    return False


def drain(policy, is_pinned=never_pinned) -> list[bytes]:
    """Victims in the order the policy gives them up."""
    out = []
    while (v := policy.pick_victim(is_pinned)) is not None:
        out.append(v)
        policy.remove(v)
    return out


def test_lru_order_touch_and_remove():
    p = LRUPolicy()
    for k in (b"a", b"b", b"c", b"d"):
        p.insert(k)
    p.touch(b"a")
    p.remove(b"c")
    p.remove(b"zz")  # unknown: ignored
    assert len(p) == 3
    assert drain(p) == [b"b", b"d", b"a"]
    assert p.pick_victim(never_pinned) is None


def test_lru_skips_pinned():
    p = LRUPolicy()
    for k in (b"a", b"b", b"c"):
        p.insert(k)
    pinned = {b"a", b"b"}
    assert p.pick_victim(pinned.__contains__) == b"c"
    assert p.pick_victim(lambda k: True) is None
    assert len(p) == 3  # picking is only a suggestion


def chain_policy(n: int) -> PrefixAwarePolicy:
    """b0 <- b1 <- ... <- b(n-1) all in this tier, inserted head first as a prefill stores them."""
    p = PrefixAwarePolicy()
    for i in range(n):
        p.insert(bytes([i]), children=0, orphan=False)
        if i:
            p.update(bytes([i - 1]), children=1, orphan=False)
    return p


def test_prefix_policy_gives_up_a_chain_from_its_tail():
    lru = LRUPolicy()
    for i in range(5):
        lru.insert(bytes([i]))
    assert lru.pick_victim(never_pinned) == bytes([0])  # plain LRU would orphan the whole chain
    p = chain_policy(5)
    order = []
    for _ in range(5):
        v = p.pick_victim(never_pinned)
        order.append(v[0])
        p.remove(v)
        if v[0]:
            p.update(bytes([v[0] - 1]), children=0, orphan=False)  # as the store reports it
    assert order == [4, 3, 2, 1, 0]


def test_prefix_policy_prefers_older_leaves_and_respects_touch():
    p = PrefixAwarePolicy()
    # two chains: a0 <- a1, c0 <- c1; a1 is the oldest leaf
    for k, parent in ((b"a0", None), (b"a1", b"a0"), (b"c0", None), (b"c1", b"c0")):
        p.insert(k)
        if parent:
            p.update(parent, children=1, orphan=False)
    assert p.pick_victim(never_pinned) == b"a1"
    p.touch(b"a1")
    assert p.pick_victim(never_pinned) == b"c1"
    p.touch(b"a0")  # touching an inner block does not make it a leaf
    p.touch(b"c1")
    assert p.pick_victim(never_pinned) == b"a1"


def test_prefix_policy_evicts_orphans_first():
    p = chain_policy(3)
    p.insert(b"tail", orphan=True)  # its parent left this tier: useless for a prefix read from here
    p.insert(b"x")
    assert p.pick_victim(never_pinned) == b"tail"
    p.update(b"tail", children=0, orphan=False)  # its parent came back (promoted)
    assert p.pick_victim(never_pinned) == bytes([2])  # now the oldest leaf again
    p.update(bytes([2]), children=0, orphan=True)
    assert p.pick_victim(never_pinned) == bytes([2])
    assert p.pick_victim({bytes([2])}.__contains__) == b"tail"


def test_prefix_policy_skips_pinned_leaves_then_falls_back_to_lru():
    p = chain_policy(3)
    p.insert(b"x")  # a lone block: a leaf too, newer than b2
    assert p.pick_victim(never_pinned) == bytes([2])
    assert p.pick_victim({bytes([2])}.__contains__) == b"x"
    # every leaf pinned: least recently used unpinned block, even if it has children
    assert p.pick_victim({bytes([2]), b"x"}.__contains__) == bytes([0])
    assert p.pick_victim(lambda k: True) is None


def test_prefix_policy_inserted_with_children_is_not_a_leaf():
    p = PrefixAwarePolicy()
    p.insert(b"parent", children=2)  # e.g. promoted back while its children are in this tier
    p.insert(b"leaf")
    assert p.pick_victim(never_pinned) == b"leaf"
    p.update(b"parent", children=0, orphan=False)
    p.touch(b"leaf")
    assert p.pick_victim(never_pinned) == b"parent"
    p.update(b"unknown", children=0, orphan=True)  # ignored
    assert len(p) == 2


def test_prefix_policy_heap_stays_bounded_under_many_touches():
    p = chain_policy(2)
    for _ in range(10_000):
        p.touch(bytes([1]))
    assert len(p._leaves) + len(p._orphans) < 4 * len(p) + 64 + 2
    assert p.pick_victim(never_pinned) == bytes([1])


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("prefix"), PrefixAwarePolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    with pytest.raises(ValueError, match="eviction_policy"):
        make_policy("random")


def run_cache(policy, capacity: int, trace: list[bytes]) -> set[bytes]:
    """Replay ``trace`` as the store does (a hit touches, a miss inserts after evicting to make
    room); returns what is cached at the end."""
    cached: set[bytes] = set()
    for key in trace:
        if key in cached:
            policy.touch(key)
            continue
        if len(cached) >= capacity:
            victim = policy.pick_victim(never_pinned)
            policy.remove(victim)
            cached.discard(victim)
        policy.insert(key)
        cached.add(key)
    return cached


def test_s3fifo_evicts_one_hit_wonders_before_reused_keys():
    hot = [b"hot%d" % i for i in range(20)]
    scan = [b"once%d" % i for i in range(400)]   # a scan of keys read once, 4x the tier
    trace = hot + hot + scan                       # the hot keys are read again before the scan
    s3 = run_cache(S3FIFOPolicy(), 100, trace)
    lru = run_cache(LRUPolicy(), 100, trace)
    assert set(hot) <= s3                          # every re-used key survived the scan
    assert not set(hot) & lru                      # LRU gave every one of them up
    # in a drain, the untouched newcomers go first
    p = S3FIFOPolicy()
    for k in (b"a", b"b", b"c", b"d"):
        p.insert(k)
    p.touch(b"a")
    p.touch(b"c")
    assert drain(p) == [b"b", b"d", b"a", b"c"]


def test_s3fifo_never_picks_pinned_keys():
    p = S3FIFOPolicy()
    keys = [b"k%d" % i for i in range(50)]
    for k in keys:
        p.insert(k)
    for k in keys[::3]:
        p.touch(k)
    pinned = set(keys[:10]) | set(keys[20:45])
    victims = []
    while (v := p.pick_victim(pinned.__contains__)) is not None:
        assert v not in pinned
        victims.append(v)
        p.remove(v)
    assert set(victims) == set(keys) - pinned      # everything else went, and nothing pinned did
    assert len(p) == len(pinned)
    assert p.pick_victim(lambda k: True) is None
    assert p.pick_victim(never_pinned) is not None  # picking is only a suggestion: nothing was lost


def test_s3fifo_ghost_hit_goes_to_main():
    p = S3FIFOPolicy()
    for k in (b"a", b"b", b"c"):
        p.insert(k)
    assert p.queue_of(b"a") == "small"
    victim = p.pick_victim(never_pinned)
    assert victim == b"a"
    p.remove(victim)
    assert p.queue_of(b"a") == "ghost"             # evicted from probation: remembered
    p.insert(b"a")                                 # wanted again soon: straight to main
    assert p.queue_of(b"a") == "main"
    p.remove(b"b")                                 # a delete, not an eviction: no ghost
    assert p.queue_of(b"b") is None
    p.insert(b"b")
    assert p.queue_of(b"b") == "small"
    # the main block outlives newcomers that are never read
    for k in (b"x", b"y", b"z"):
        p.insert(k)
    assert drain(p)[-1] == b"a"


def test_s3fifo_ghosts_stay_bounded():
    p = S3FIFOPolicy()
    for i in range(5000):
        p.insert(b"%d" % i)
        if len(p) > 10:
            p.remove(p.pick_victim(never_pinned))
    ghosts = sum(p.queue_of(b"%d" % i) == "ghost" for i in range(5000))
    assert 0 < ghosts <= S3FIFOPolicy.MIN_GHOSTS

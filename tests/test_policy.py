"""Eviction policies on metadata alone: LRU order, prefix-aware leaf-first, S3-FIFO probation, pinned
blocks skipped; one policy per tier (``eviction_policy: {cpu: s3fifo, nvme: lru}``) in a Store and in
a real daemon, and a bad per-tier key refused naming it."""

from __future__ import annotations

import random
import subprocess
from collections import OrderedDict

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.ops.local_daemon import serve_command
from kvstore.service.config import ConfigError, load_settings
from kvstore.store import Store, StoreConfig
from kvstore.store.policy import LRUPolicy, PrefixAwarePolicy, S3FIFOPolicy, make_policy, make_tier_policies
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import NvmeTier


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


def test_lru_recovered_keys_go_first_oldest_first_and_victims_named_at_once_match_one_by_one():
    p = LRUPolicy()
    p.insert_many([b"r0", b"r1", b"r2", b"r3", b"r4"])   # a warm restart's keys, oldest first
    p.insert(b"n0")
    p.touch(b"r1")        # read since the restart: now the newest
    p.remove(b"r4")       # gone, leaving a hole where the oldest are
    p.remove(b"r0")
    assert len(p) == 4
    pinned = {b"r3"}
    one_by_one = []
    while (key := p.pick_victim(pinned.__contains__)) is not None:
        one_by_one.append(key)
        pinned.add(key)   # as clear_room pins each victim it names
    assert one_by_one == [b"r2", b"n0", b"r1"]
    assert p.pick_victims({b"r3"}.__contains__, 2) == [b"r2", b"n0"]
    assert p.pick_victims({b"r3"}.__contains__, 10) == one_by_one
    assert drain(p) == [b"r2", b"r3", b"n0", b"r1"]


def test_lru_names_victims_as_a_linked_recency_list_would_through_many_rounds():
    """Random inserts, reads, removals, pins and victim searches against an ``OrderedDict``
    (least recently used first, ``move_to_end`` on a read): every search names the same keys."""
    rng = random.Random(39)
    p, ref, pinned = LRUPolicy(), OrderedDict(), set()
    p.insert_many([b"r%d" % i for i in range(8)])   # dormant first
    ref.update(dict.fromkeys(b"r%d" % i for i in range(8)))
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            keys = [b"k%d-%d" % (step, i) for i in range(rng.randrange(1, 4))]
            p.insert_run(keys)
            ref.update(dict.fromkeys(keys))
        elif op < 0.5 and ref:
            keys = rng.sample(list(ref), min(len(ref), 3))
            p.touch_many(keys)
            for key in keys:
                ref.move_to_end(key)
        elif op < 0.6 and ref:
            key = rng.choice(list(ref))
            p.remove(key)
            del ref[key]
        elif op < 0.7:
            pinned = set(rng.sample(list(ref), len(ref) // 3))
        else:
            n = rng.randrange(1, 6)
            victims = p.pick_victims(pinned.__contains__, n)
            assert victims == [k for k in ref if k not in pinned][:n], step
            assert p.pick_victim(pinned.__contains__) == (victims[0] if victims else None)
            for key in victims[:rng.randrange(0, n + 1)]:
                p.remove(key)
                del ref[key]
        assert len(p) == len(ref)
    assert drain(p) == list(ref)


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


def test_prefix_policy_falls_back_in_recency_order_touches_and_recovered_keys_included():
    p = PrefixAwarePolicy()
    p.insert_many([b"r0", b"r1", b"r2"], [(1, False), (1, False), (0, False)])   # a recovered chain
    p.insert(b"n0", children=1)
    p.insert(b"n1")
    leaves = {b"r2", b"n1"}.__contains__
    assert p.pick_victim(leaves) == b"r0"
    p.touch(b"r0")   # now the most recently used
    assert p.pick_victim(leaves) == b"r1"
    p.remove(b"r1")
    assert p.pick_victim(leaves) == b"n0"
    p.insert(b"n0", children=1)   # inserted again: not a use, its place is kept
    assert p.pick_victim(leaves) == b"n0"
    assert p.pick_victim(lambda k: k != b"r0") == b"r0"


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


def test_prefix_policy_touch_many_names_the_victims_touch_by_touch_would():
    """``touch_many`` (one loop for a batch of reads) against ``touch`` key by key, through random
    inserts, updates, reads of awake and dormant keys, removals and victim searches with pins,
    and past ``PENDING_MAX`` pending keys: every search names the same victim."""
    rng = random.Random(39)
    batch, one_by_one = PrefixAwarePolicy(), PrefixAwarePolicy()
    batch.PENDING_MAX = one_by_one.PENDING_MAX = 7
    recovered = [b"r%d" % i for i in range(40)]
    chains = [(int(i % 5 != 4), False) for i in range(40)]   # chains of five, recovered dormant
    held = list(recovered)
    for p in (batch, one_by_one):
        p.insert_many(recovered, chains)
    for step in range(3000):
        op = rng.random()
        if op < 0.25:
            key, state = b"k%d" % step, (rng.randrange(3), rng.random() < 0.2)
            held.append(key)
            for p in (batch, one_by_one):
                p.insert(key, *state)
        elif op < 0.55 and held:
            keys = rng.sample(held, min(len(held), rng.randrange(1, 12)))
            batch.touch_many(keys)
            for key in keys:
                one_by_one.touch(key)
        elif op < 0.65 and held:
            key, state = rng.choice(held), (rng.randrange(3), rng.random() < 0.2)
            for p in (batch, one_by_one):
                p.update(key, *state)
        elif op < 0.75 and held:
            key = held.pop(rng.randrange(len(held)))
            for p in (batch, one_by_one):
                p.remove(key)
        else:
            pinned = set(rng.sample(held, len(held) // 3)).__contains__
            victim = one_by_one.pick_victim(pinned)
            assert batch.pick_victim(pinned) == victim, step
            if victim is not None and rng.random() < 0.5:
                held.remove(victim)
                for p in (batch, one_by_one):
                    p.remove(victim)
        assert len(batch) == len(one_by_one) == len(held)
    assert drain(batch) == drain(one_by_one)


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


# -- one policy per tier ---------------------------------------------------------------------------

def per_tier_trace(store, ns: bytes, block_bytes: int) -> dict[str, bool]:
    """Four-block CPU and NVMe tiers, every block its own one-block chain. H is stored and read
    once, then X1..X7 fill the CPU tier and demote X1..X4 onto NVMe, X1 is read there (no
    promotion), then X8..X11 push four more blocks down. Whether H is still in the CPU tier shows
    the CPU tier's policy (S3-FIFO moves a block read during probation to main; LRU and prefix
    give up H, the least recently used); whether X1 is still on NVMe shows NVMe's (LRU gives X1
    up on the fourth eviction after its read; S3-FIFO keeps it in main)."""
    def block(i: int) -> bytes:
        return ChainHasher().chain([i] * 64, 64)[0]

    payload = np.zeros(block_bytes, dtype=np.uint8)
    h, xs = block(0), [block(i) for i in range(1, 12)]
    store.put(ns, [h], [payload])
    assert store.get(ns, [h]) == [payload.tobytes()]
    for x in xs[:7]:
        store.put(ns, [x], [payload])
    assert store.lookup(ns, xs[:4], lease=False).tiers[:1] == ["nvme"]
    assert store.get(ns, [xs[0]]) == [payload.tobytes()]
    for x in xs[7:]:
        store.put(ns, [x], [payload])
    return {"h_in_cpu": store.lookup(ns, [h], lease=False).tiers == ["cpu"],
            "x1_on_nvme": store.lookup(ns, [xs[0]], lease=False).tiers == ["nvme"]}


SMALL_LAYOUT = KVLayout(model="test/per-tier", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16",
                        block_tokens=64, block_bytes=4096)


@pytest.mark.parametrize("spec, expected", [
    ("lru", {"h_in_cpu": False, "x1_on_nvme": False}),
    ("prefix", {"h_in_cpu": False, "x1_on_nvme": False}),
    ("s3fifo", {"h_in_cpu": True, "x1_on_nvme": True}),
    ({"cpu": "s3fifo", "nvme": "lru"}, {"h_in_cpu": True, "x1_on_nvme": False}),   # no single policy does this
    ({"cpu": "lru", "nvme": "s3fifo"}, {"h_in_cpu": False, "x1_on_nvme": True}),
])
def test_store_builds_each_tiers_own_policy(tmp_path, spec, expected):
    nvme = NvmeTier(str(tmp_path / "nvme"), 4 * NvmeTier(str(tmp_path / "probe"), 1 << 20).footprint(4096))
    store = Store([CpuTier(4 * 4096, slot_bytes=4096, shm_dir=str(tmp_path)), nvme],
                  StoreConfig(eviction_policy=spec, promote_on_hit=False, lease_seconds=0))
    try:
        names = {t: s["policy"] for t, s in store.stats()["tiers"].items()}
        assert names == ({"cpu": spec, "nvme": spec} if isinstance(spec, str) else spec)
        ns = store.register_namespace(Namespace(SMALL_LAYOUT))
        assert per_tier_trace(store, ns, SMALL_LAYOUT.block_bytes) == expected
    finally:
        store.close()


def test_per_tier_policies_unnamed_tiers_and_bad_names():
    assert [p.name for p in make_tier_policies({"nvme": "lru"}, ["cpu", "nvme"])] == ["prefix", "lru"]
    assert [p.name for p in make_tier_policies({"gpu": "lru"}, ["cpu"])] == ["prefix"]   # no such tier here
    assert [p.name for p in make_tier_policies("s3fifo", ["cpu", "nvme"])] == ["s3fifo", "s3fifo"]
    with pytest.raises(ValueError, match=r"eviction_policy\.nvme: unknown 'fifo'"):
        make_tier_policies({"cpu": "lru", "nvme": "fifo"}, ["cpu", "nvme"])
    with pytest.raises(ValueError, match=r"eviction_policy: unknown 'fifo'"):
        make_tier_policies("fifo", ["cpu"])


def test_per_tier_setting_is_validated_naming_the_key():
    assert load_settings(None, eviction_policy={"cpu": "s3fifo", "nvme": "lru"}).eviction_policy == \
        {"cpu": "s3fifo", "nvme": "lru"}
    assert load_settings(None, eviction_policy="lru").eviction_policy == "lru"
    with pytest.raises(ConfigError) as e:
        load_settings(None, eviction_policy={"cpu": "s3fifo", "nvme": "fifo"})
    assert "eviction_policy.nvme:" in str(e.value) and "'lru', 'prefix' or 's3fifo'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings(None, eviction_policy={"tape": "lru"})
    assert "eviction_policy.tape: unknown key" in str(e.value) and "'cpu', 'nvme'" in str(e.value)


DAEMON_LAYOUT = KVLayout(model="test/per-tier-daemon", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                         block_tokens=64, block_bytes=256 * 1024)
# four 256 KiB blocks in each tier: 4 CPU slots, 4 NVMe files (4 KiB header + the block)
DAEMON_TIERS = {"cpu_bytes": "1MiB", "nvme_bytes": str(4 * (256 + 4) * 1024)}


def test_daemon_runs_the_per_tier_policies_of_its_config(daemon_factory, tmp_path):
    """The daemon builds each tier's policy from ``eviction_policy: {cpu: s3fifo, nvme: lru}``: its
    stats name them, and the CPU tier keeps a block read once through a scan of new blocks, which a
    daemon with ``eviction_policy: lru`` gives up. (A daemon serves an NVMe hit through the CPU
    arena, so NVMe's own eviction order is checked on a Store above.)"""
    def hot_block_after_a_scan(c) -> list[str]:
        ns = c.register_namespace(Namespace(DAEMON_LAYOUT))
        payload = np.zeros(DAEMON_LAYOUT.block_bytes, dtype=np.uint8)
        hot, *scan = (ChainHasher().chain([i] * 64, 64)[0] for i in range(8))
        c.put(ns, [hot], [payload])
        assert c.get(ns, [hot]) == [payload.tobytes()]
        for h in scan:                     # 7 blocks never read: the CPU tier holds 4, NVMe the 4 oldest
            c.put(ns, [h], [payload])
        return c.lookup(ns, [hot], lease=False).tiers

    config = tmp_path / "kv.yaml"
    config.write_text("eviction_policy: {cpu: s3fifo, nvme: lru}\n")
    d = daemon_factory("--config", str(config), **DAEMON_TIERS)
    with d.client() as c:
        tiers = c.stats()["tiers"]
        assert {t: tiers[t]["policy"] for t in ("cpu", "nvme")} == {"cpu": "s3fifo", "nvme": "lru"}
        assert hot_block_after_a_scan(c) == ["cpu"]
        tiers = c.stats()["tiers"]
        assert (tiers["cpu"]["policy_blocks"], tiers["nvme"]["policy_blocks"]) == (4, 4)

    config.write_text("eviction_policy: lru\n")    # a plain name: every tier
    d = daemon_factory("--config", str(config), **DAEMON_TIERS)
    with d.client() as c:
        tiers = c.stats()["tiers"]
        assert {t: tiers[t]["policy"] for t in ("cpu", "nvme")} == {"cpu": "lru", "nvme": "lru"}
        assert hot_block_after_a_scan(c) == ["nvme"]


@pytest.mark.parametrize("policy, key", [("{cpu: s3fifo, nvme: fifo}", "eviction_policy.nvme"),
                                         ("{cpu: s3fifo, tape: lru}", "eviction_policy.tape")])
def test_serve_refuses_a_bad_per_tier_policy_naming_the_key(tmp_path, policy, key):
    config = tmp_path / "kv.yaml"
    config.write_text(f"eviction_policy: {policy}\n")
    r = subprocess.run(serve_command("--config", str(config), "--listen", "127.0.0.1:0", "--nvme-path",
                                     str(tmp_path / "nvme")), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert key + ":" in r.stderr


class RecordingPrefixPolicy(PrefixAwarePolicy):
    """Remembers the (children, orphan) each key was last given by ``insert_run``."""

    def __init__(self) -> None:
        super().__init__()
        self.told: dict[bytes, tuple[int, bool]] = {}

    def insert_run(self, keys, chains=None) -> None:
        keys, chains = list(keys), list(chains)
        self.told.update(zip(keys, chains))
        super().insert_run(keys, chains)


def test_a_published_run_tells_each_block_the_chain_state_it_has():
    """``BlockIndex.show_run`` tells the policies what ``chain_state`` says of each block of a run
    once the run is linked: a chain into one tier (parent before, one child after), its first
    block an orphan, a block given a child before it was published, a block in a slower tier, a
    run continuing a visible chain."""
    from kvstore.store.index import BlockIndex, Entry, PlainCopy

    index = BlockIndex([RecordingPrefixPolicy(), RecordingPrefixPolicy()])
    ns = b"n" * 16

    def entry(i: int, parent: int | None, tier: int = 0) -> Entry:
        e = Entry(ns + b"%016d" % i, None if parent is None else index.entries[ns + b"%016d" % parent].key
                  if ns + b"%016d" % parent in index.entries else ns + b"%016d" % parent, 4096)
        e.hold_plain(PlainCopy(tier, 4096, 0))
        index.entries[e.key] = e
        return e

    def check(run: list[Entry]) -> None:
        index.show_run(run)
        for e in run:
            t = e.first()
            assert index.policies[t].told[e.key] == index.chain_state(e, t), e
            assert e.visible

    check([entry(i, None if i == 0 else i - 1) for i in range(6)])   # 0 has no parent
    check([entry(10 + i, 99 if i == 0 else 10 + i - 1) for i in range(6)])   # 10: an orphan
    early = entry(23, 22)   # published before its parent: 22 has a child already when its run is
    check([early])
    check([entry(20, 5), entry(21, 20), entry(22, 21), entry(24, 22, tier=1), entry(25, 24), entry(26, 25)])
    check([entry(30 + i, 26 if i == 0 else 30 + i - 1) for i in range(4)])   # continues a visible chain

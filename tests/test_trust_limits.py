"""Trust, memory and tenancy limits of a real ``kvstore serve`` (issue 17, items 4-6).

Each test fails on a daemon without the limit: tier-sized blocks were accepted, a maximal
LookupBatch cost seconds and hundreds of MB that stayed in RSS, every namespace registration
rewrote one world-readable ``namespaces.json`` under the store lock, a tenant could register
namespaces without end, same-host (PrepareStore) reservations escaped the quota, and every tenant
saw every tenant's figures in Stats.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import grpc
import numpy as np
import psutil
import pytest

from daemon_util import wait_codecs_warm
from kvstore import KVLayout, Namespace
from kvstore.errors import BlockTooLarge, InvalidArgument, QuotaExceeded, UnknownNamespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import MAX_BATCH, MAX_LOOKUP_BATCH, MAX_LOOKUP_HASHES

KiB, MiB = 1 << 10, 1 << 20
#: the RSS a daemon may keep above its baseline once a hostile burst is over (docs/guarantees.md);
#: measured at this commit: 13-40 MiB above the baseline 20 s after a burst that peaked 100-440 MiB
#: above it, once 69 MiB (a full CI run); a daemon that kept the burst would stay at its peak
RSS_SLACK = 96 * MiB


def layout(block_bytes: int, model: str = "trust/limits") -> KVLayout:
    return KVLayout(model=model, num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", block_tokens=1,
                    block_bytes=block_bytes)


def hashes(n: int, seed: int) -> list[bytes]:
    return [seed.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


def payload(h: bytes, nbytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "kv.yaml"
    path.write_text(text)
    return str(path)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def trailing(err: grpc.RpcError) -> dict:
    return dict(err.trailing_metadata() or ())


# -- memory bounds ---------------------------------------------------------------------------------

def test_block_bytes_capped_at_registration_naming_the_field(daemon_factory, tmp_path):
    # 64 MiB CPU tier, 256 MiB NVMe tier, max_block_bytes 8 MiB (a quarter of the CPU tier would be 16 MiB)
    d = daemon_factory("--config", write_config(tmp_path, "max_block_bytes: 8MiB\n"))
    with d.client(transport="grpc") as c:
        stub = pb_grpc.KVStoreStub(c.channel)
        for block_bytes in (64 * MiB, 9 * MiB):
            err = rpc_error(lambda: stub.RegisterNamespace(pb.RegisterNamespaceRequest(
                layout=pb.Layout(**layout(block_bytes).to_dict())), timeout=10))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert trailing(err).get("kvstore-field") == "layout.block_bytes", trailing(err)
            assert "layout.block_bytes" in err.details() and "max_block_bytes" in err.details(), err.details()
        with pytest.raises(BlockTooLarge) as e:
            c.register_namespace(Namespace(layout(9 * MiB)))
        assert e.value.field == "layout.block_bytes"
        ns = c.register_namespace(Namespace(layout(8 * MiB)))       # at the cap: accepted and usable
        h = hashes(1, seed=1)
        assert c.put(ns, h, [payload(h[0], 8 * MiB)]) == ["stored"]
        assert c.stats()["tiers"]["cpu"]["blocks"] >= 1                # auth off: Stats stays store-wide


def test_maximal_lookup_batch_is_refused_quickly(daemon_factory):
    d = daemon_factory()
    with d.client(transport="grpc", timeout_s=30) as c:
        ns = c.register_namespace(Namespace(layout(4 * KiB)))
        chain = [bytes([1 + j % 255]) for j in range(MAX_BATCH)]
        biggest = pb.LookupBatchRequest(requests=[pb.LookupRequest(namespace_id=ns, hashes=chain)] * MAX_LOOKUP_BATCH)
        stub = pb_grpc.KVStoreStub(c.channel)
        daemon = psutil.Process(d.pid)
        cpu0 = sum(daemon.cpu_times()[:2])
        err = rpc_error(lambda: stub.LookupBatch(biggest, timeout=30))
        cpu = sum(daemon.cpu_times()[:2]) - cpu0   # the daemon's own work (wall time varies with the machine's load)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and trailing(err).get("kvstore-field") == "chains", err
        assert cpu < 1.0, f"refusing a maximal LookupBatch cost the daemon {cpu:.2f}s of CPU"
        # at the cap it is answered; beyond it the client splits the chains over several calls
        at_cap = MAX_LOOKUP_HASHES // MAX_BATCH
        assert len(stub.LookupBatch(pb.LookupBatchRequest(
            requests=[pb.LookupRequest(namespace_id=ns, hashes=chain)] * at_cap), timeout=30).responses) == at_cap
        assert [lk.num_hit for lk in c.lookup_many(ns, [chain] * (at_cap + 3))] == [0] * (at_cap + 3)


def private_bytes(proc: psutil.Process) -> int:
    """The daemon's resident memory of its own (heap, stacks): RSS less shared pages. The CPU
    arena is shared memory whose pages stay resident once a block has been written into them, up
    to the configured tier size, so counting it would charge a burst with filling the cache."""
    info = proc.memory_info()
    return info.rss - info.shared


def test_rss_returns_near_baseline_after_a_hostile_burst(daemon_factory):
    d = daemon_factory()                       # 64 MiB CPU tier: blocks of at most 16 MiB (a quarter)
    proc = psutil.Process(d.pid)
    small, big = 256 * KiB, 16 * MiB
    for i, transport in enumerate(("grpc", "bulk", "grpc", "bulk")):   # warm both paths up
        with d.client(transport=transport) as c:
            ns = c.register_namespace(Namespace(layout(small)))
            h = hashes(4, seed=10 + i)
            c.put(ns, h, [payload(x, small) for x in h])
            assert c.get(ns, h)[0] is not None
    wait_codecs_warm(d)
    time.sleep(3)
    baseline = private_bytes(proc)
    failures: list[str] = []

    def put_big(i: int) -> None:
        with d.client(transport=("grpc", "bulk")[i % 2], timeout_s=60) as c:
            ns_big = c.register_namespace(Namespace(layout(big, model=f"trust/burst{i}")))
            h = hashes(2, seed=100 + i)
            c.put(ns_big, h, [payload(x, big) for x in h])
            c.get(ns_big, h)

    def oversized(i: int) -> None:
        with d.client(transport="grpc") as c:
            try:
                c.register_namespace(Namespace(layout(64 * MiB, model=f"trust/huge{i}")))
                failures.append("a 64 MiB block was accepted on a 64 MiB tier")
            except BlockTooLarge as e:
                assert "smallest tier" in str(e), e

    def maximal_lookup(_: int) -> None:
        with d.client(transport="grpc", timeout_s=30) as c:
            ns_l = c.register_namespace(Namespace(layout(small)))
            chain = [bytes([1 + j % 255]) for j in range(MAX_BATCH)]
            try:
                c.call("LookupBatch", pb.LookupBatchRequest(
                    requests=[pb.LookupRequest(namespace_id=ns_l, hashes=chain)] * MAX_LOOKUP_BATCH))
                failures.append("a maximal LookupBatch was answered")
            except InvalidArgument:
                pass

    def guarded(f, i: int) -> None:
        try:
            f(i)
        except Exception as e:  # noqa: BLE001 - reported by the test thread below
            failures.append(f"{f.__name__}({i}): {type(e).__name__}: {e}")

    workers = [threading.Thread(target=guarded, args=(f, i)) for i, f in
               enumerate([put_big] * 8 + [oversized] * 3 + [maximal_lookup] * 2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    assert not failures, failures
    peak = private_bytes(proc)
    deadline = time.monotonic() + 20
    while private_bytes(proc) > baseline + RSS_SLACK and time.monotonic() < deadline:
        time.sleep(0.5)
    after = private_bytes(proc)
    assert after <= baseline + RSS_SLACK, (f"private RSS {after / MiB:.0f} MiB stayed above baseline "
                                           f"{baseline / MiB:.0f} MiB + {RSS_SLACK / MiB:.0f} MiB "
                                           f"(peak {peak / MiB:.0f} MiB)")
    print(f"private RSS baseline {baseline / MiB:.0f} MiB, after the burst {peak / MiB:.0f} MiB, settled "
          f"{after / MiB:.0f} MiB (arena and other shared pages {proc.memory_info().shared / MiB:.0f} MiB)")
    with d.client(transport="grpc") as c:      # and the daemon still serves
        assert c.health()


# -- namespaces: incremental, private, capped -------------------------------------------------------

def test_namespace_registrations_do_not_stall_other_tenants_and_survive_restart(daemon_factory, tmp_path):
    tokens = ["--token", "alice-secret=alice", "--token", "bob-secret=bob"]
    nvme = str(tmp_path / "nvme")
    d = daemon_factory(*tokens, nvme_path=nvme)
    n_namespaces = 800
    with d.client(token="alice-secret", transport="grpc") as alice, \
            d.client(token="bob-secret", transport="grpc") as bob:
        ns_b = bob.register_namespace(Namespace(layout(64 * KiB)))
        h = hashes(1, seed=7)
        bob.put(ns_b, h, [payload(h[0], 64 * KiB)])
        latencies: list[float] = []
        done = threading.Event()

        def bob_gets() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                assert bob.get(ns_b, h)[0] is not None
                latencies.append(time.perf_counter() - t0)

        reader = threading.Thread(target=bob_gets)
        reader.start()
        try:
            ids = [alice.register_namespace(Namespace(layout(64 * KiB), cache_salt=f"salt-{i}"))
                   for i in range(n_namespaces)]
        finally:
            done.set()
            reader.join(30)
        p99 = float(np.percentile(latencies, 99)) if latencies else float("inf")
        assert len(latencies) >= 50 and p99 < 0.05, f"{len(latencies)} gets, p99 {p99 * 1e3:.1f} ms"
    registry = os.path.join(nvme, "namespaces")
    assert stat.S_IMODE(os.stat(registry).st_mode) == 0o700
    files = os.listdir(registry)
    assert len(files) == n_namespaces + 1 and not os.path.exists(os.path.join(nvme, "namespaces.json"))
    assert {stat.S_IMODE(os.stat(os.path.join(registry, f)).st_mode) for f in files} == {0o600}
    assert d.stop() == 0
    again = daemon_factory(*tokens, nvme_path=nvme)
    with again.client(token="alice-secret", transport="grpc") as alice, \
            again.client(token="bob-secret", transport="grpc") as bob:
        assert alice.exists(ids[-1], h) == [False]          # known without registering again
        assert bob.exists(ns_b, h) == [True]
        with pytest.raises(UnknownNamespace):
            bob.exists(ids[0], h)                           # still alice's, not bob's


def test_namespaces_per_tenant_are_capped(daemon_factory, tmp_path):
    d = daemon_factory("--config", write_config(tmp_path, "max_namespaces_per_tenant: 3\n"
                                                          "tokens: {alice-secret: alice, bob-secret: bob}\n"))
    with d.client(token="alice-secret", transport="grpc") as alice, \
            d.client(token="bob-secret", transport="grpc") as bob:
        mine = [alice.register_namespace(Namespace(layout(4 * KiB), cache_salt=str(i))) for i in range(3)]
        with pytest.raises(QuotaExceeded) as e:
            alice.register_namespace(Namespace(layout(4 * KiB), cache_salt="one too many"))
        assert e.value.field == "namespaces" and "max_namespaces_per_tenant" in str(e.value)
        assert "alice" not in str(e.value)
        stub = pb_grpc.KVStoreStub(alice.channel)
        err = rpc_error(lambda: stub.RegisterNamespace(pb.RegisterNamespaceRequest(
            layout=pb.Layout(**layout(4 * KiB).to_dict()), cache_salt="again"),
            metadata=(("authorization", "Bearer alice-secret"),), timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert alice.register_namespace(Namespace(layout(4 * KiB), cache_salt="0")) == mine[0]   # idempotent
        assert bob.register_namespace(Namespace(layout(4 * KiB)))                                # another tenant
    assert "alice-secret" not in d.log() and "bob-secret" not in d.log()


# -- quotas ----------------------------------------------------------------------------------------

def test_prepare_store_reservations_count_against_the_quota(daemon_factory):
    """The same-host path: auth off (the shared arena is offered), tenant ``q`` with 1 MiB."""
    block = 256 * KiB
    d = daemon_factory("--quota", "q=1MiB")
    with d.client(transport="shm") as c:
        assert c.active_transport == "shm"
        ns = c.register_namespace(Namespace(layout(block), tenant="q"))
        chain = hashes(32, seed=3)                                   # 8 MiB
        # reservations held open: 4 blocks (1 MiB) reserved, the 5th refused while they are open
        leases = [c.call("PrepareStore", pb.PrepareStoreRequest(namespace_id=ns, hashes=[h], block_bytes=block))
                  for h in chain[:4]]
        with pytest.raises(QuotaExceeded):
            c.call("PrepareStore", pb.PrepareStoreRequest(namespace_id=ns, hashes=chain[4:5], block_bytes=block))
        def charged() -> int:
            return c.stats()["tenants"]["q"]["charged_bytes"]        # auth off: Stats is store-wide
        assert charged() == 4 * block
        for lease in leases:
            c.call("AbortStore", pb.LeaseRequest(lease_id=lease.lease_id))
        assert charged() == 0                                        # aborted: released
        stored, refused = 0, 0
        for i in range(0, len(chain), 2):
            try:
                stored += len(c.put(ns, chain[i:i + 2], [payload(h, block) for h in chain[i:i + 2]]))
            except QuotaExceeded:
                refused += 1
        assert stored == 4 and refused == 14, (stored, refused)
        assert charged() == 1 * MiB
        assert sum(c.exists(ns, chain)) == 4


# -- stats -----------------------------------------------------------------------------------------

def test_stats_show_a_tenant_only_its_own_figures_and_admins_everything(daemon_factory, tmp_path):
    d = daemon_factory("--config", write_config(tmp_path, "tokens: {alice-secret: alice, bob-secret: bob, "
                                                          "ops-secret: ops}\nadmin_tenants: [ops]\n"))
    with d.client(token="alice-secret", transport="grpc") as alice, \
            d.client(token="bob-secret", transport="grpc") as bob, \
            d.client(token="ops-secret", transport="grpc") as ops:
        ns_a = alice.register_namespace(Namespace(layout(16 * KiB)))
        h = hashes(5, seed=9)
        alice.put(ns_a, h, [payload(x, 16 * KiB) for x in h])
        ns_b = bob.register_namespace(Namespace(layout(16 * KiB)))
        seen_by_bob = bob.stats()
        raw = json.dumps(seen_by_bob)
        assert ns_a.hex() not in raw and "alice" not in raw, raw
        for store_wide in ("tiers", "counters", "tenants", "leases"):
            assert store_wide not in seen_by_bob, seen_by_bob
        assert seen_by_bob["server"]["tenant"] == "bob" and seen_by_bob["server"]["tenant_bytes"] == 0
        assert seen_by_bob["blocks"] == 0 and seen_by_bob["namespaces"] == 1
        assert list(seen_by_bob["by_namespace"]) == [ns_b.hex()]
        seen_by_alice = alice.stats()
        assert seen_by_alice["blocks"] == 5 and seen_by_alice["bytes"] == 5 * 16 * KiB
        assert seen_by_alice["by_namespace"][ns_a.hex()] == {"blocks": 5, "bytes": 5 * 16 * KiB}
        seen_by_ops = ops.stats()
        assert seen_by_ops["blocks"] == 5 and "cpu" in seen_by_ops["tiers"]
        assert seen_by_ops["tenants"]["alice"]["charged_bytes"] == 5 * 16 * KiB and "bob" in seen_by_ops["tenants"]
    log = d.log()
    assert not any(t in log for t in ("alice-secret", "bob-secret", "ops-secret"))


# -- the same limits in the Store alone (what the fleet's peer fetch and the planner use) ---------

def small_store(path, cpu_bytes: int = 8 * 64 * KiB, **config):
    from kvstore.store import Store, StoreConfig
    from kvstore.tiers.cpu import CpuTier
    from kvstore.tiers.nvme import NvmeTier

    return Store([CpuTier(cpu_bytes, slot_bytes=64 * KiB), NvmeTier(str(path), 64 * MiB)], StoreConfig(**config))


def test_store_quota_counts_puts_reservations_and_recovered_blocks(tmp_path):
    block = 64 * KiB
    store = small_store(tmp_path / "nvme", tenant_quotas={"q": 4 * block}, lease_seconds=60)
    ns = store.register_namespace(Namespace(layout(block), tenant="q"))
    h = hashes(8, seed=5)
    assert store.put(ns, h[:2], [payload(x, block) for x in h[:2]]) == ["stored"] * 2   # a peer fetch's path
    lease = store.leases.prepare_store(ns, h[2:4])
    assert store.tenant_bytes("q") == 4 * block
    with pytest.raises(QuotaExceeded):
        store.put(ns, h[4:5], [payload(h[4], block)])
    with pytest.raises(QuotaExceeded), store.quota_hold(ns, h[4:5]):
        pass
    store.leases.abort_store(lease.id)
    assert store.tenant_bytes("q") == 2 * block
    lease = store.leases.prepare_store(ns, h[2:4])
    assert store.leases.expire(now=float("inf")) == 1 and store.tenant_bytes("q") == 2 * block
    assert store.delete(ns, h[:1]) == 1 and store.tenant_bytes("q") == block
    store.put(ns, h[4:7], [payload(x, block) for x in h[4:7]])
    assert store.tenant_bytes("q") == 4 * block
    store.flush()
    store.close()
    again = small_store(tmp_path / "nvme", tenant_quotas={"q": 4 * block})
    assert again.tenant_bytes("q") == 4 * block                     # recovered blocks still count
    assert again.tenant_stats("q")["blocks"] == 4 and again.tenant_stats("other")["blocks"] == 0
    again.close()


def test_store_caps_block_bytes_and_namespaces_per_tenant(tmp_path):
    store = small_store(tmp_path / "nvme", max_block_bytes=1 * MiB, min_blocks_per_tier=4,
                        max_namespaces_per_tenant=2)
    assert store.largest_block_bytes == 128 * KiB                    # a quarter of the 512 KiB CPU tier
    with pytest.raises(BlockTooLarge, match="1/4 of the smallest tier"):
        store.register_namespace(Namespace(layout(256 * KiB)))
    store.register_namespace(Namespace(layout(128 * KiB), tenant="t"))
    store.register_namespace(Namespace(layout(64 * KiB), tenant="t"))
    with pytest.raises(QuotaExceeded) as e:
        store.register_namespace(Namespace(layout(32 * KiB), tenant="t"))
    assert e.value.field == "namespaces" and store.stats()["counters"]["namespaces_refused_cap"] == 1
    store.register_namespace(Namespace(layout(32 * KiB), tenant="u"))
    store.close()


def test_namespace_files_skip_planted_entries(tmp_path):
    from kvstore.store.namespace_files import DIR_NAME

    nvme = tmp_path / "nvme"
    store = small_store(nvme)
    ns_id = store.register_namespace(Namespace(layout(4 * KiB), cache_salt="kept"))
    store.close()
    registry = nvme / DIR_NAME
    planted_fifo, planted_link = Namespace(layout(8 * KiB)), Namespace(layout(16 * KiB))
    os.mkfifo(registry / f"{planted_fifo.id.hex()}.json")
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(planted_link.to_dict()))
    os.symlink(target, registry / f"{planted_link.id.hex()}.json")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    new = Namespace(layout(32 * KiB))
    os.symlink(victim, registry / f"{new.id.hex()}.json.tmp")       # a write through it would hit the victim

    store = small_store(nvme)                                        # a FIFO would hang an open(); it must not
    known = {ns.id for ns in store.namespaces()}
    assert known == {ns_id}
    assert store.stats()["counters"]["namespace_files_skipped_not_regular"] == 2
    store.register_namespace(new)
    assert victim.read_text() == "untouched"
    assert stat.S_IMODE(os.stat(registry / f"{new.id.hex()}.json").st_mode) == 0o600
    store.close()

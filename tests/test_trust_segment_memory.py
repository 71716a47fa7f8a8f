"""Replaced tenant segments are bounded (issue 35, attack 5), against real daemons.

A segment that passes to another tenant gets fresh memory; a client that keeps its old mapping or
descriptor keeps the old memory alive. The attacker is a real process (the reliability suite's
segment holder) that takes and keeps every segment its tenant is handed while segments cycle
between two tenants; the scenario counts the pages of every segment memfd the processes still
reference (``benchmarks/reliability.py segments_cycle``, run in its own process).
"""

from __future__ import annotations

import numpy as np

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon
import reliability_runner

MiB = 1 << 20
LIMIT = "max_held_segment_bytes_per_tenant"


def cycle(workdir, mode: str) -> dict:
    return reliability_runner.run("segments_cycle", str(workdir), cycles=3, cpu_bytes="16MiB", segment_bytes="1MiB",
                                  mode=mode)


def test_a_client_keeping_replaced_segments_holds_no_memory_and_is_cut_off(tmp_path):
    r = cycle(tmp_path, "keep")
    rounds = r["rounds"]
    assert r["bound_bytes"] == 16 * MiB + 2 * 16 * MiB
    for x in rounds:   # the daemon released the old pages when it replaced each segment
        assert x["current_bytes"] == 16 * MiB and x["replaced_bytes"] == 0, x
        assert x["b_stored"] == 64 and x["b_exact"] and x["b_transport"] == "shm", x
    # the holder's tenant holds a whole arena of replaced segments: it is handed nothing more
    assert rounds[0]["a_stored"] == 64 and rounds[0]["replaced_segments"] == 16
    for x in rounds[1:]:
        assert x["a_stored"] == 0 and LIMIT in x["a_put_error"], x
        assert x["a_held_segments"] == 16 and x["replaced_segments"] == 16, x
    assert r["daemon_cpu_tier"]["replaced_segments_held"] == 16   # counted against A until it lets go
    assert r["ok"]


def test_a_client_touching_replaced_segments_holds_at_most_its_limit(tmp_path):
    r = cycle(tmp_path, "touch")
    rounds = r["rounds"]
    for x in rounds:
        assert x["replaced_bytes"] <= 16 * MiB, x   # what it wrote back into what it keeps, no more
        assert x["current_bytes"] + x["replaced_bytes"] <= r["bound_bytes"], x
        assert x["b_stored"] == 64 and x["b_exact"], x
    assert rounds[-1]["replaced_bytes"] == 16 * MiB   # it did fault the pages back in
    assert r["ok"]


LAYOUT = KVLayout(model="test/segment-memory", num_layers=2, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                  block_tokens=128)   # 256 KiB blocks


def test_honest_clients_let_go_of_replaced_segments_and_keep_shared_memory(tmp_path):
    """Two honest tenants fill the arena in turn: each time every segment passes to the other. Their
    clients are told which segments were replaced and let go of them, so with a limit of one arena
    neither is ever refused (without letting go, each would be refused on its second fill)."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    d = start_local_daemon(tmp_path / "d", "--token", "a-token=a", "--token", "b-token=b", "--token", "ops-token=ops",
                           "--shm-dir", str(shm_dir), cpu_bytes="8MiB", nvme_bytes="0",
                           env={"KVSTORE_CPU_SEGMENT_BYTES": "1MiB", "KVSTORE_MAX_HELD_SEGMENT_BYTES_PER_TENANT": "8MiB",
                                "KVSTORE_ADMIN_TENANTS": '["ops"]'})
    n = 8 * MiB // LAYOUT.block_bytes
    try:
        with d.client(token="a-token") as a, d.client(token="b-token") as b:
            spaces = {a: a.register_namespace(Namespace(LAYOUT)), b: b.register_namespace(Namespace(LAYOUT))}
            for turn in range(6):
                c = (a, b)[turn % 2]
                hashes = ChainHasher(seed=turn).chain(list(range(n * LAYOUT.block_tokens)), LAYOUT.block_tokens)
                data = [np.full(LAYOUT.block_bytes, turn * 7 + i, np.uint8) for i in range(n)]
                assert c.put(spaces[c], hashes, data) == ["stored"] * n
                assert c.get(spaces[c], hashes) == [x.tobytes() for x in data]
                assert c.active_transport == "shm"
        with d.client(token="ops-token", transport="grpc") as ops:   # the clients are gone: so are their mappings
            assert ops.stats()["tiers"]["cpu"]["replaced_segments_held"] == 0
    finally:
        assert d.stop() == 0

"""Hostile input through the raw generated stubs: randomized malformed, truncated, oversized and
wrong-type requests to every RPC, and slowloris clients. Every answer is a defined status, the
daemon stays up, and leases, slots and streams return to baseline. The long version (10k+
requests) is ``python benchmarks/reliability.py fuzz``."""

from __future__ import annotations

import reliability_runner as R

NO_LEAKS = {"leases": 0, "client_leases": 0, "open_streams": 0, "reserved_unpublished_cpu_slots": 0}


def test_fuzz_every_rpc_gets_defined_statuses_and_leaks_nothing(tmp_path):
    r = R.run("fuzz", str(tmp_path), requests=340, seed=11)
    assert r["requests"] >= 340
    assert r["undefined_answers"] == 0, r["undefined_examples"]
    assert len([m for m in r["outcomes"] if not m.startswith("raw")]) >= 17, r["outcomes"]  # every RPC reached
    assert r["outcomes"]["oversized"] == {"RESOURCE_EXHAUSTED": 1}
    assert r["daemon_alive"] and r["daemon_log_errors"] == 0
    assert r["leaks"] == NO_LEAKS, r["leaks"]
    assert r["stored_blocks_still_exact"] == 8


def test_slowloris_clients_cannot_starve_others_or_leak(tmp_path):
    # more stalled streams than the daemon has worker threads (16)
    r = R.run("slowloris", str(tmp_path), stallers=25)
    assert r["normal_client_exact"] == 2, r            # served despite the stallers (within its 10 s deadline)
    assert r["stalled_streams_cancelled"] >= 15, r     # stalled Put / Get / BulkPut streams were cut
    assert r["leaks_after_expiry"] == NO_LEAKS, r
    assert r["leases_expired"] >= 10, r
    assert r["cpu_blocks_after"] == r["cpu_blocks_before"], r
    assert r["daemon_alive"] and r["daemon_log_errors"] == 0

"""Crash test (CI size): random kill -9 of a real daemon during mixed put/get/lookup/delete traffic
over every transport, with a CPU tier of 16 blocks so demotion happens all the time; restart on
the same NVMe directory after each kill. The long version (>= 50 kills) is
``python benchmarks/reliability.py crash`` (results in benchmarks/results/reliability.md)."""

from __future__ import annotations

import reliability_runner as R


def test_kill_9_loop_loses_nothing_acknowledged_and_serves_no_wrong_byte(tmp_path):
    r = R.run("crash_test", str(tmp_path), kills=10, traffic_s=(0.3, 1.0), seed=3)
    assert r["kills"] == 10 and r["restarts"] == 10
    assert r["exit_codes"] == {"-9": 10}                   # each death was our kill, not a crash
    assert r["persisted_acks"] > 0 and r["blocks_served"] > 0 and r["deletes"] > 0, r
    assert r["lost"] == 0, r                               # every acknowledged-persisted block came back
    assert r["wrong_bytes_served"] == 0, r["wrong_examples"]  # while the daemon ran ...
    assert r["wrong_after_restart"] == 0, r["wrong_examples"]  # ... and after every restart
    assert r["persisted_missed_live"] == 0, r
    assert r["resurrected_after_delete"] == 0, r
    assert r["daemon_log_errors"] == 0
    # what clients saw while the daemon was down: DaemonUnavailable, nothing else
    assert set(r["client_errors_by_type"]) <= {"DaemonUnavailable"}, r["client_errors_by_type"]

"""Load smoke and dependencies down: concurrent sync and asyncio clients see no errors and no wrong
byte; a daemon killed mid-request makes every transport raise DaemonUnavailable promptly (never
hang), and the same clients work again once it is back; Redis going away does not break the
Store or the fleet. The 64-client version is ``python benchmarks/reliability.py load``."""

from __future__ import annotations

import pytest

import reliability_runner as R


def test_concurrent_clients_smoke(tmp_path):
    out = R.run_full("load", str(tmp_path), clients=12, seconds=3, procs=2)
    r = out["result"]
    for run in (r["single_client"], r["concurrent"]):
        assert run["error_count"] == 0, run["errors"]
        assert run["wrong_bytes"] == 0
        assert all(run["latency"][op]["n"] > 0 for op in out["load_ops"]), run["latency"]
    assert r["concurrent"]["clients"] == 12
    assert r["daemon_alive"] and r["daemon_log_errors"] == 0


def test_daemon_killed_mid_request_then_back(tmp_path):
    r = R.run("daemon_killed_mid_request", str(tmp_path))
    for transport, (res,) in r["per_transport"].items():
        assert not res["hung"], (transport, res)
        assert res["raised"] == "DaemonUnavailable", (transport, res)
        assert res["seconds_to_raise"] < r["client_timeout_s"] + 2, (transport, res)
        assert res["wrong"] == 0 and res["wrong_after_restart"] == 0, (transport, res)
        assert res["hits_after_restart"] == 6, (transport, res)            # persisted blocks, same client object
        assert res["transport_after"] == transport, (transport, res)       # renegotiated with the new daemon


def test_redis_down_and_back(tmp_path):
    try:
        r = R.run("redis_down", str(tmp_path))
    except R.Unsupported as e:
        pytest.skip(str(e))
    assert r["errors_while_down"] == [], r
    assert r["store_exact_while_down"] == 8, r
    assert r["republished_after_restart"], r

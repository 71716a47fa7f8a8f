"""kvstore as LMCache's L2 storage: the L2 adapter plugin, driven by LMCache's own code.

Runs in LMCache's own venv (it pins numpy/protobuf/grpcio differently from ours): the checks in
tests/engines/lmcache_l2.py, and LMCache's `lmcache bench l2` CLI with the plugin adapter and
round-trip verification on, both against a real kvstore daemon.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from venvs import engine_env, engine_venv  # tests/engines (on sys.path via conftest)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = {"type": "plugin", "module_path": "kvstore.connectors.lmcache", "class_name": "KVStoreL2Adapter"}


@pytest.fixture(scope="module")
def lmcache_venv() -> str:
    return engine_venv("lmcache")


@pytest.fixture(scope="module")
def adapter_checks(lmcache_venv, kv_daemon) -> dict:
    proc = subprocess.run([os.path.join(lmcache_venv, "bin", "python"),
                           os.path.join(REPO, "tests", "engines", "lmcache_l2.py"), "--url", kv_daemon.url],
                          capture_output=True, text=True, timeout=600, env=engine_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)  # the first test also runs the driver in LMCache's venv
@pytest.mark.parametrize("check", ["roundtrip", "isolation", "daemon_down", "bad_config"])
def test_l2_adapter(adapter_checks, check):
    result = adapter_checks[check]
    assert result["ok"], result["detail"]


@pytest.mark.timeout(600)
def test_lmcache_bench_l2_with_kvstore_plugin(lmcache_venv, kv_daemon, tmp_path):
    """LMCache's own benchmark loads the plugin by module path and verifies every byte it reads back."""
    out = tmp_path / "bench.json"
    spec = dict(PLUGIN, adapter_params={"url": kv_daemon.url})
    proc = subprocess.run([os.path.join(lmcache_venv, "bin", "lmcache"), "bench", "l2", "--l2-adapter",
                           json.dumps(spec), "--num-keys", "8", "--data-size-kb", "64", "--rounds", "2",
                           "--no-skip-verify", "--lookup-max-hit-rate", "1.0", "--format", "json",
                           "--output", str(out)],
                          capture_output=True, text=True, timeout=600, env=engine_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "data verified OK" in proc.stdout + proc.stderr
    metrics = json.loads(out.read_text())["metrics"]
    ops = {v["operation"]: v for k, v in metrics.items() if k.startswith("op_")}
    for op in ("Store", "Lookup", "Load"):
        assert ops[op]["total_success"] == ops[op]["total_keys"] > 0, (op, ops[op])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_lmcache_mp_server_runs_with_kvstore_l2(lmcache_venv, kv_daemon, tmp_path):
    """LMCache's multiprocess server (what vLLM's LMCacheMPConnector talks to) loads the plugin
    as its L2 and reports it healthy, talking to the daemon."""
    import time
    import urllib.request

    zmq_port, http_port = _free_port(), _free_port()
    spec = dict(PLUGIN, adapter_params={"url": kv_daemon.url})
    log = open(tmp_path / "mp-server.log", "w")
    proc = subprocess.Popen([os.path.join(lmcache_venv, "bin", "python"), "-m", "lmcache.v1.multiprocess.http_server",
                             "--host", "127.0.0.1", "--port", str(zmq_port), "--http-host", "127.0.0.1",
                             "--http-port", str(http_port), "--chunk-size", "32", "--l1-size-gb", "0.0625",
                             "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                             "--l2-adapter", json.dumps(spec)],
                            stdout=log, stderr=subprocess.STDOUT, env=engine_env(), cwd=str(tmp_path))
    try:
        deadline, status = time.monotonic() + 180, {}
        while "l2_adapters" not in status.get("storage_manager", {}):  # answers before it is up
            assert proc.poll() is None, (tmp_path / "mp-server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "MP server never answered /status"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
                    status = json.loads(r.read())
            except OSError:
                pass
            time.sleep(0.5)
        adapters = status["storage_manager"]["l2_adapters"]
        assert [a["type"] for a in adapters] == ["KVStoreL2Adapter"], adapters
        assert adapters[0]["is_healthy"] is True and adapters[0]["url"] == kv_daemon.url, adapters
        assert status["storage_manager"]["store_controllers"]["_default"]["num_active_adapters"] == 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

"""Every mistake an operator makes with the ``kvstore`` CLI ends in one line naming the setting,
value or file, exit 1 or 2, and no traceback; suspicious settings are warned of at start.

Each case runs the real CLI in a subprocess (``python -P -m kvstore.ops.cli``, a clean
environment), against a real daemon, a real Redis or a real busy port where it needs one.
"""

from __future__ import annotations

import os
import socket
import shutil
import subprocess
import sys

import pytest

from daemon_util import start_daemon


def kvstore(*args: str, cwd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHONPATH"))}
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-P", "-m", "kvstore.ops.cli", *args], capture_output=True, text=True,
                          env=child_env, cwd=cwd, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess, *names: str, code: int | tuple = (1, 2)) -> str:
    """The one error line of a failed command (log WARNING lines aside), checked to name ``names``."""
    assert r.returncode in ((code,) if isinstance(code, int) else code), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and " WARNING " not in line]
    assert len(lines) == 1, r.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def serve_flags(tmp_path) -> list[str]:
    return ["--cpu-bytes", "32MiB", "--nvme-bytes", "64MiB", "--nvme-path", str(tmp_path / "nvme")]


def test_plan_with_a_missing_workload_file(tmp_path):
    r = kvstore("plan", "--model", "llama3-8b", "--workload", "missing.jsonl", "--bandwidth", "cpu=19,nvme=3",
                cwd=tmp_path)
    one_line_error(r, "missing.jsonl", "No such file", code=2)


def test_plan_with_a_codec_table_that_is_not_there(tmp_path):
    r = kvstore("plan", "--model", "llama3-8b", "--workload", "chat", "--codec-table", "nope.json", cwd=tmp_path)
    one_line_error(r, "codec_table", "nope.json", code=2)


def test_bench_with_an_unknown_transport(tmp_path):
    r = kvstore("bench", "--transports", "tcp", "--sizes", "64KiB", "--total", "1MiB", cwd=tmp_path)
    one_line_error(r, "transports", "'tcp'", code=2)


def test_route_with_a_url_that_is_not_redis(tmp_path):
    r = kvstore("route", "--redis", "http://127.0.0.1:6379", "--namespace", "00" * 16, "--hashes", "00",
                cwd=tmp_path, env={"KVSTORE_FLEET__SECRET": "a-fleet-secret-of-some-length"})
    one_line_error(r, "--redis", "redis://", "http://", code=2)


@pytest.mark.parametrize("config, setting", [("redis_tier:\n  url: http://user:pw@example:6379\n", "redis_tier.url"),
                                             ("fleet:\n  redis_url: http://user:pw@example:6379\n", "fleet.redis_url")])
def test_a_redis_url_with_a_bad_scheme_names_its_setting_and_hides_its_password(tmp_path, config, setting):
    (tmp_path / "kv.yaml").write_text(config)
    r = kvstore("serve", "--config", str(tmp_path / "kv.yaml"), *serve_flags(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert setting in r.stderr and "redis://" in r.stderr and "pw" not in r.stderr, r.stderr
    other = {"redis_tier.url": "fleet.redis_url", "fleet.redis_url": "redis_tier.url"}[setting]
    assert other not in r.stderr


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_metrics_port_taken_names_the_port_and_the_setting(tmp_path, busy_port):
    r = kvstore("serve", "--listen", "127.0.0.1:0", "--metrics-port", str(busy_port), *serve_flags(tmp_path),
                cwd=tmp_path)
    one_line_error(r, "metrics_port", f"127.0.0.1:{busy_port}", code=1)


def test_grpc_port_taken_is_one_clear_line_without_grpc_core_logging(tmp_path, busy_port):
    r = kvstore("serve", "--listen", f"127.0.0.1:{busy_port}", *serve_flags(tmp_path), cwd=tmp_path)
    line = one_line_error(r, "listen", f"127.0.0.1:{busy_port}", code=1)
    assert "add_port" not in r.stderr and line.startswith("kvstore serve:")


def test_nvme_tier_larger_than_its_disk_is_warned_of_by_name(tmp_path):
    room = shutil.disk_usage(tmp_path).free
    d = start_daemon(tmp_path / "d", cpu_bytes="32MiB", nvme_bytes=str(room + (1 << 40)))
    try:
        log = d.log()
        with d.client() as c:
            assert c.health()
    finally:
        d.stop()
    line = next(ln for ln in log.splitlines() if "nvme_bytes:" in ln)
    assert "room for" in line and "persisted" in line and str(tmp_path / "d") in line, line


def test_a_cpu_arena_on_a_disk_backed_filesystem_is_warned_of_naming_shm_dir(tmp_path):
    """The test's directory is on the host's disk (ext4 here): an arena there is written back to
    it, and the daemon says so at start; the default, /dev/shm, draws no such line."""
    from kvstore.service.preflight import MEMORY_FILESYSTEMS, filesystem_of

    kind = filesystem_of(str(tmp_path))
    if kind is None or kind in MEMORY_FILESYSTEMS:
        pytest.skip(f"the test directory is on {kind}, not on a disk")
    arena = tmp_path / "arena"
    arena.mkdir()
    on_disk = start_daemon(tmp_path / "disk", "--shm-dir", str(arena), cpu_bytes="16MiB", nvme_bytes="0")
    in_memory = start_daemon(tmp_path / "memory", cpu_bytes="16MiB", nvme_bytes="0")
    try:
        for d in (on_disk, in_memory):
            with d.client() as c:
                assert c.health()
        disk_log, memory_log = on_disk.log(), in_memory.log()
    finally:
        on_disk.stop()
        in_memory.stop()
    line = next(ln for ln in disk_log.splitlines() if "shm_dir:" in ln)
    assert " WARNING " in line and str(arena) in line and kind in line and "/dev/shm" in line, line
    assert "shm_dir:" not in memory_log, memory_log


def test_a_cpu_tier_larger_than_the_memory_left_is_refused_naming_cpu_bytes(tmp_path):
    r = kvstore("serve", "--listen", "127.0.0.1:0", "--cpu-bytes", "60TiB", "--nvme-bytes", "0", cwd=tmp_path)
    line = one_line_error(r, "cpu_bytes: 65970697666560 bytes requested", "memory are available", code=1)
    assert "lower --cpu-bytes" in line


def test_a_misspelt_environment_variable_is_warned_of_naming_the_real_setting(tmp_path):
    d = start_daemon(tmp_path / "d", env={"KVSTORE_LEASE_SECOND": "3", "KVSTORE_FLEET_ENABLED": "true"})
    try:
        log = d.log()
    finally:
        d.stop()
    assert "KVSTORE_LEASE_SECOND is not a kvstore setting" in log and "did you mean KVSTORE_LEASE_SECONDS?" in log
    assert "KVSTORE_FLEET_ENABLED is not a kvstore setting" in log and "KVSTORE_FLEET__ENABLED" in log
    assert "3" not in log.split("KVSTORE_LEASE_SECOND")[1].split("\n")[0].replace("KVSTORE_LEASE_SECONDS", "")


def test_stats_and_top_json_into_a_closed_pipe_end_quietly(kv_daemon, tmp_path):
    for command in (["stats", "--json"], ["top", "--json"], ["stats"]):
        p = subprocess.Popen([sys.executable, "-P", "-m", "kvstore.ops.cli", *command, "--url", kv_daemon.address],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        p.stdout.close()   # the reader is gone before the first byte: `| head -c0`
        err = p.stderr.read().decode()
        p.wait(60)
        assert p.returncode == 1 and "Traceback" not in err and "BrokenPipe" not in err, (command, err)


def test_stats_with_a_tenant_token_says_an_admin_token_shows_more(tmp_path):
    d = start_daemon(tmp_path / "d", "--token", "alice-token=alice", cpu_bytes="16MiB", nvme_bytes="64MiB",
                     client_kwargs={"token": "alice-token"})
    try:
        r = kvstore("stats", "--url", d.address, "--token", "alice-token", cwd=tmp_path)
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr
    assert "tenant 'alice'" in r.stdout and "admin_tenants" in r.stdout and "admin token" in r.stdout


SECRET = "operator-errors-fleet-secret-0123"


def test_route_says_when_the_key_prefix_or_the_secret_is_wrong(tmp_path, redis_url, prefix):
    """A route that finds no node because of a wrong --key-prefix or secret exits 1 saying which;
    the right ones find the node that holds the blocks (exit 0)."""
    import time

    import numpy as np

    from kvstore.keys import ChainHasher, KVLayout, Namespace

    config = tmp_path / "kv.yaml"
    config.write_text(f"fleet:\n  enabled: true\n  redis_url: {redis_url}\n  key_prefix: {prefix}\n"
                      f"  node_id: node-a\n  heartbeat_s: 0.2\n  secret: {SECRET}\n")
    d = start_daemon(tmp_path / "d", "--config", str(config), cpu_bytes="16MiB", nvme_bytes="32MiB")
    try:
        layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16", block_tokens=16)
        hashes = ChainHasher().chain(np.arange(3 * 16), 16)
        with d.client() as c:
            ns = c.register_namespace(Namespace(layout))
            c.put(ns, hashes, [np.full(layout.block_bytes, i, np.uint8) for i in range(3)])

        def route(key_prefix: str, secret: str) -> subprocess.CompletedProcess:
            return kvstore("route", "--redis", redis_url, "--key-prefix", key_prefix, "--namespace", ns.hex(),
                           "--hashes", ",".join(h.hex() for h in hashes), cwd=tmp_path,
                           env={"KVSTORE_FLEET__SECRET": secret})

        deadline = time.monotonic() + 30
        while (ok := route(prefix, SECRET)).returncode != 0 or "node-a" not in ok.stdout:
            assert time.monotonic() < deadline, ok.stderr + ok.stdout   # published within a few heartbeats
            time.sleep(0.2)
        one_line_error(route(prefix + "-typo", SECRET), "key prefix", "--key-prefix", code=1)
        one_line_error(route(prefix, "another-fleets-secret-0123456789"), "secret", code=1)
    finally:
        d.stop()

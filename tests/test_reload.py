"""Reload against a real daemon: SIGHUP and `kvstore reload` re-read tokens, quotas, the pin bound and
the log level without dropping blocks or connections; a bad file is refused, the old configuration
kept, and the error names the key without echoing a token."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client.rpc_errors import RemoteError
from kvstore.errors import QuotaExceeded, Unauthenticated
from kvstore.ops import admin_cli
from kvstore.ops.cli import main as kvstore

LAYOUT = KVLayout(model="test/reload", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16,
                  block_bytes=256 * 1024)
HASHES = ChainHasher().chain(list(range(64)), 16)
BLOCKS = [np.random.default_rng(i).integers(0, 256, LAYOUT.block_bytes, np.uint8) for i in range(4)]


def write_config(path, tokens: str, extra: str = "") -> None:
    path.write_text(textwrap.dedent(f"""
        tokens: {tokens}
        admin_tenants: [ops]
    """) + textwrap.dedent(extra))


def wait_until(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    raise AssertionError("timed out")


def refused(client) -> bool:
    try:
        client.stats()
    except Unauthenticated:
        return True
    return False


@pytest.fixture
def daemon(daemon_factory, tmp_path):
    config = tmp_path / "kv.yaml"
    write_config(config, "{old-token-s3cret: alice, ops-token: ops}", "quotas: {alice: 4MiB}\n")
    d = daemon_factory("--config", str(config), cpu_bytes="8MiB", nvme_bytes="16MiB")
    d.config = config
    return d


def test_sighup_rotates_a_token_keeping_blocks_and_connections(daemon):
    d = daemon
    with d.client(token="old-token-s3cret") as alice, d.client(token="ops-token") as ops:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, HASHES, BLOCKS)
        server_id = ops.stats()["server"]["server_id"]
        write_config(d.config, "{new-token-s3cret: alice, ops-token: ops}", "quotas: {alice: 4MiB}\n")
        os.kill(d.pid, signal.SIGHUP)
        wait_until(lambda: refused(alice))                        # the old token is refused from the next call
        with d.client(token="new-token-s3cret") as rotated:
            assert rotated.register_namespace(Namespace(LAYOUT)) == ns   # same tenant, same namespace
            assert rotated.get(ns, HASHES) == [b.tobytes() for b in BLOCKS]   # blocks intact
        stats = ops.stats()                                        # the connection made before still works
        assert stats["server"]["server_id"] == server_id and stats["blocks"] == 4
    log = d.log()
    assert "reload: applied tokens" in log
    assert "s3cret" not in log


def test_bad_config_is_refused_and_the_old_one_kept(daemon, capsys):
    d = daemon
    with d.client(token="old-token-s3cret") as alice, d.client(token="ops-token") as ops:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, HASHES[:1], BLOCKS[:1])
        write_config(d.config, "{new-token-s3cret: [not, a, tenant], ops-token: ops}", "quotas: {alice: lots}\n")
        with pytest.raises(RemoteError) as err:
            admin_cli.reload(ops)
        message = str(err.value)
        assert "tokens" in message and "quotas.alice" in message and "s3cret" not in message
        capsys.readouterr()
        assert kvstore(["reload", "--url", d.address, "--token", "ops-token"]) == 1
        out = capsys.readouterr()
        assert "quotas.alice" in out.err and "s3cret" not in out.err
        os.kill(d.pid, signal.SIGHUP)
        wait_until(lambda: d.log().count("reload refused") >= 3)
        assert not refused(alice) and alice.exists(ns, HASHES[:1]) == [True]    # old tokens still in force
        # turning authentication off is refused too, naming the key
        write_config(d.config, "{}")
        with pytest.raises(RemoteError, match="tokens: a reload cannot turn authentication off"):
            admin_cli.reload(ops)
        assert not refused(alice)
    log = d.log()
    assert "quotas.alice" in log and "s3cret" not in log


def test_reload_applies_quotas_and_log_level_and_names_what_needs_a_restart(daemon, capsys):
    d = daemon
    with d.client(token="old-token-s3cret") as alice:
        ns = alice.register_namespace(Namespace(LAYOUT))
        alice.put(ns, HASHES[:2], BLOCKS[:2])
        write_config(d.config, "{old-token-s3cret: alice, ops-token: ops}", """
            quotas: {alice: 768KiB}
            max_pinned_bytes_per_tenant: 256KiB
            log_level: debug
            lease_seconds: 2.5
        """)
        capsys.readouterr()
        assert kvstore(["reload", "--url", d.address, "--token", "ops-token", "--json"]) == 0
        done = json.loads(capsys.readouterr().out)
        assert done == {"applied": ["log_level", "max_pinned_bytes_per_tenant", "quotas"],
                        "ignored": ["lease_seconds"]}
        alice.put(ns, HASHES[2:3], BLOCKS[2:3])                  # 768 KiB: exactly the new quota
        with pytest.raises(QuotaExceeded):
            alice.put(ns, HASHES[3:4], BLOCKS[3:4])
        with pytest.raises(QuotaExceeded, match="max_pinned_bytes_per_tenant"):
            admin_cli.prefix_call(alice, "Pin", ns, HASHES[:2])
        assert alice.get(ns, HASHES[:3]) == [b.tobytes() for b in BLOCKS[:3]]
        assert alice.stats()["server"]["tenant_bytes"] == 3 * LAYOUT.block_bytes
    assert "changed but need a restart, not applied: lease_seconds" in d.log()

"""What ``kvstore serve`` says when it starts: listen addresses, auth and fleet on/off, each tier's
size as resolved, where it lives, its policy and codec; after a warm restart, the blocks it found
per tier and the time that took. A real daemon, started and restarted on the same NVMe directory."""

from __future__ import annotations

import re

import numpy as np

from daemon_util import start_daemon
from kvstore.keys import ChainHasher, KVLayout, Namespace


def banner(log: str) -> list[str]:
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kvstore: serving on"))
    out = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def test_banner_names_every_tier_and_a_warm_restart_counts_what_it_found(tmp_path):
    nvme = tmp_path / "nvme"
    d = start_daemon(tmp_path / "a", "--token", "t0ken=alice", "--eviction-policy", "s3fifo", "--metrics-port", "0",
                     cpu_bytes="40MB", nvme_bytes="64MiB", nvme_path=str(nvme), client_kwargs={"token": "t0ken"})
    try:
        first = banner(d.log())
        # the arena's allocation and first touches (seconds for a large one) are announced and timed
        assert re.search(r"cpu tier: allocating and touching its 38\.1 MiB arena in \S+: done in \d+\.\ds", d.log())
        layout = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
        hashes = ChainHasher().chain(np.arange(5 * 16), 16)
        with d.client() as c:
            ns = c.register_namespace(Namespace(layout))
            assert c.put(ns, hashes, [np.full(layout.block_bytes, i, np.uint8) for i in range(5)]) == ["stored"] * 5
    finally:
        assert d.stop() == 0   # flushes the five blocks to the NVMe tier
    assert re.fullmatch(rf"kvstore: serving on {re.escape(d.address)}, metrics on 127\.0\.0\.1:{d.metrics_port}, "
                        r"auth on \(1 tenants\), fleet off", first[0]), first[0]
    cpu = next(line for line in first if line.startswith("  tier cpu"))
    nvme_line = next(line for line in first if line.startswith("  tier nvme"))
    # 40MB is 40,000,000 bytes: shown as what it resolves to (whole 256 KiB slots: 152 of them)
    assert "38.0 MiB (39845888 bytes)" in cpu and "policy s3fifo" in cpu and "codec raw" in cpu
    assert "64.0 MiB (67108864 bytes)" in nvme_line and str(nvme) in nvme_line
    assert not any("warm restart" in line for line in first)   # a fresh directory: nothing found

    again = start_daemon(tmp_path / "b", cpu_bytes="16MiB", nvme_bytes="64MiB", nvme_path=str(nvme))
    try:
        second = banner(again.log())
    finally:
        again.stop()
    assert second[0].endswith("metrics off, auth off, fleet off")
    found = [line for line in second if "warm restart" in line]
    assert len(found) == 1 and re.search(r"found nvme 5 blocks \([0-9.]+ KiB\) in \d+\.\d\ds", found[0]), second

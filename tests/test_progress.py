"""Progress of work that takes seconds, read where an operator reads it when output is piped: the
daemon's log while it fills its arena and recovers an NVMe tier on a warm restart, ``kvstore plan``'s
stderr while it replays (one process and several), ``kvstore prewarm``'s over several batches.
``KVSTORE_PROGRESS_EVERY_S`` shortens the interval between lines so small runs show several;
without it a short step prints none (a line every 2 s, not a flood)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.keys import ChainHasher, KVLayout, Namespace

EVERY = {"KVSTORE_PROGRESS_EVERY_S": "0.02"}
# 1 layer x 2 (K,V) x 16 tokens x 1 head x 64 dim x 2 bytes = 4 KiB blocks: one 8 KiB NVMe slot each
LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16", block_tokens=16)
BLOCKS = 4000
CHAT = "chat:system_prompts=3,system_tokens=64,user_tokens=16,reply_tokens=16,turns=6,rate=4,think_s=2"


def counts(lines: list[str], pattern: str) -> list[int]:
    return [int(re.search(pattern, line).group(1).replace(",", "")) for line in lines if re.search(pattern, line)]


def test_warm_restart_and_arena_fill_show_progress_and_what_they_took(tmp_path):
    nvme = str(tmp_path / "nvme")
    d = start_daemon(tmp_path / "a", "--cpu-slot-bytes", "4KiB", cpu_bytes="8MiB", nvme_bytes="64MiB", nvme_path=nvme)
    hashes = ChainHasher().chain(np.arange(BLOCKS * 16), 16)
    try:
        with d.client() as c:
            ns = c.register_namespace(Namespace(LAYOUT))
            block = np.zeros(LAYOUT.block_bytes, np.uint8)
            for lo in range(0, BLOCKS, 1024):
                c.put(ns, hashes[lo:lo + 1024], [block] * len(hashes[lo:lo + 1024]), parent=hashes[lo - 1] if lo else None)
    finally:
        assert d.stop() == 0   # what is left in the CPU tier is flushed down: all 4000 on NVMe
    first = d.log()
    # milliseconds of work at the default interval: no progress line, only the outcome
    assert "filling its arena:" not in first and "recovering:" not in first
    assert re.search(r"nvme tier: recovered 0 blocks in \d+\.\d\ds", first)

    again = start_daemon(tmp_path / "b", "--cpu-slot-bytes", "4KiB", cpu_bytes="256MiB", nvme_bytes="64MiB",
                         nvme_path=nvme, env=EVERY)
    again.stop()
    log = again.log().splitlines()
    filled = [line for line in log if "cpu tier: filling its arena:" in line]
    assert filled, again.log()
    assert all(re.search(r"of 256\.0 MiB \(\d+\.\d\d GB/s\), \d+\.\ds$", line) for line in filled), filled
    done = [float(x) for x in re.findall(r"filling its arena: ([0-9.]+) MiB of", "\n".join(filled))]
    assert done == sorted(done) and done[0] < 256, filled
    recovered = [float(m.group(1)) for line in log
                 if (m := re.search(rf"nvme tier: recovered {BLOCKS} blocks in (\d+\.\d\d)s \([\d,]+ blocks/s\)$", line))]
    assert recovered, again.log()
    recovering = [line for line in log if "nvme tier: recovering:" in line]
    found = counts(recovering, r"recovering: ([\d,]+) blocks \([\d,]+ blocks/s\)")
    assert len(found) == len(recovering) and found == sorted(found) and all(0 < n <= BLOCKS for n in found), recovering
    # a line every interval while it runs: a recovery that outlasts two intervals shows at least one
    # (one read of the slab's record file can find all 4,000 blocks within a single interval)
    if recovered[0] >= 2 * float(EVERY["KVSTORE_PROGRESS_EVERY_S"]):
        assert found, (recovered, again.log())
    assert any(re.search(rf"warm restart: found nvme {BLOCKS} blocks \(31\.2 MiB\) in \d+\.\d\ds", line)
               for line in log), again.log()


def _plan(tmp_path, *extra: str, env=EVERY) -> subprocess.CompletedProcess:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                                  "hidden_size": 64, "torch_dtype": "float16"}))
    argv = ["--model", str(config), "--block-tokens", "16", "--requests", "1000", "--workload",
            CHAT,
            "--cpu", "40KiB,160KiB", "--nvme", "0", "--policy", "prefix,lru", "--bandwidth", "cpu=19,nvme=3",
            "--prefill-tok-s", "20000", "--cpu-slot-bytes", "512", "--out", str(tmp_path / "plan"), *extra]
    return subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "plan", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **env})


@pytest.mark.parametrize("extra", [["--jobs", "1"], ["--jobs", "2", "--json"]], ids=["one_process", "two_json"])
def test_plan_shows_requests_replayed_in_one_process_and_in_several(tmp_path, extra):
    """Two processes count in shared memory; --json keeps the progress (stderr) and stdout is the report."""
    r = _plan(tmp_path, *extra)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    replayed = counts(lines, r"kvstore plan: chat, ([\d,]+) of [\d,]+ requests \([\d,]+ requests/s\)")
    # stderr holds the progress lines only: the requests replayed, then the outputs being written
    assert len(replayed) == len(lines) - 1 >= 2, r.stderr
    assert re.fullmatch(rf"kvstore plan: \[1/1\] writing {tmp_path}/plan.json, \S+.md and \S+.png \(\d+s\)", lines[-1])
    total = counts(lines[:1], r" of ([\d,]+) requests")[0]   # 4 candidates x the workload's requests
    assert replayed == sorted(replayed) and replayed[0] < total, replayed
    if "--json" in extra:
        assert 4 * json.loads(r.stdout)["requests"] == total
    else:   # stdout: the candidates as they finish and the table
        assert "requests/s" not in r.stdout and "hit " in r.stdout


def test_prewarm_over_several_batches_says_each_batch(tmp_path):
    d = start_daemon(tmp_path / "d", cpu_bytes="16MiB")
    try:
        with d.client() as c:
            ns = c.register_namespace(Namespace(LAYOUT)).hex()
        hashes = tmp_path / "hashes"   # three batches of the wire's 4096: blocks that are not here
        hashes.write_text("\n".join(h.hex() for h in ChainHasher().chain(np.arange(9000 * 16), 16)))
        r = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "prewarm", ns, "--hashes-file", str(hashes),
                            "--url", d.address], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **EVERY})
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == "kvstore prewarm: [1/3] blocks 0..4,096 of 9,000 (0s)", r.stderr
    assert "0 blocks copied into the CPU tier" in r.stdout and "[1/3]" not in r.stdout


def test_bench_against_a_live_daemon_shows_its_steps_labels_sizes_names_ceilings_and_leaves_no_namespace(tmp_path):
    d = start_daemon(tmp_path / "d", cpu_bytes="64MiB")
    try:
        r = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "bench", "--url", d.address, "--sizes", "1MB",
                            "--total", "1MB", "--transports", "shm"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **EVERY}, cwd=tmp_path)
        with d.client() as c:
            from kvstore.ops.admin_cli import list_namespaces
            left = list_namespaces(c)
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [line for line in r.stderr.splitlines() if line.startswith("kvstore bench: [")]
    assert steps and steps[0].startswith("kvstore bench: [1/"), r.stderr   # piped: a line per step
    table = r.stdout.splitlines()
    # 1 MB is not 1 MiB: the size labelled as it is, and the ceilings each ratio divides by printed
    assert any(line.split()[:2] == ["976.56KiB", "ceilings:"] and "memcpy from cold sources" in line for line in table)
    assert any(line.split()[:2] == ["976.56KiB", "shm"] for line in table), r.stdout
    assert left == [], left   # the namespaces it registered are dropped again


def test_plan_on_a_terminal_draws_a_bar_that_reaches_the_end(tmp_path):
    """stderr a terminal (a pty, as under an operator's shell): rich's bar, redrawn in place, with
    the count and the rate; its last frame shows every request replayed."""
    import pty
    import select

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                                  "hidden_size": 64, "torch_dtype": "float16"}))
    main, side = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "kvstore.ops.cli", "plan", "--model", str(config), "--block-tokens",
                          "16", "--requests", "500", "--workload", CHAT,
                          "--cpu", "40KiB,160KiB", "--nvme", "0", "--policy", "prefix", "--bandwidth", "cpu=19,nvme=3",
                          "--prefill-tok-s", "20000", "--cpu-slot-bytes", "512", "--jobs", "2",
                          "--out", str(tmp_path / "plan"), "--json"],
                         stdin=side, stdout=subprocess.DEVNULL, stderr=side, cwd=tmp_path,
                         env={**os.environ, "COLUMNS": "80", "TERM": "xterm"})
    os.close(side)
    seen = b""
    while True:
        ready, _, _ = select.select([main], [], [], 120)
        try:
            chunk = os.read(main, 65536) if ready else b""
        except OSError:   # the child closed its end
            chunk = b""
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert p.wait(timeout=60) == 0
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    frames = [f for f in re.split(r"[\r\n]", screen) if f.startswith("kvstore plan: chat")]
    assert frames and "Traceback" not in screen, screen[-2000:]
    total = counts(frames[-1:], r"/([\d,]+) requests")[0]
    assert re.search(rf"━ {total:,}/{total:,} requests [\d,]+/s \d:\d\d:\d\d", frames[-1]), frames[-1]
    assert all(len(f) <= 80 for f in frames), max(frames, key=len)

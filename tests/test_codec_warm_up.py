"""The codec kernels' warm-up in a real daemon on an empty numba cache (a fresh install, an
upgrade): the compile runs in a child process, so the daemon's own threads keep the GIL for the
requests they answer; the daemon then loads the kernels from numba's cache, and the blocks they
decode are byte for byte the torch reference's. A daemon without tier codecs imports neither torch
nor numba until a lossy codec call arrives."""

from __future__ import annotations

import functools
import os
import re
import time

import numpy as np
import psutil
import pytest
import codec_blocks
from daemon_util import wait_codecs_warm

from kvstore import codecs
from kvstore.codecs import CODEC_IDS, decode_block, encode_block
from kvstore.keys import KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon

fast_cpu = pytest.importorskip("kvstore.codecs.fast_cpu")   # (numba installed)
from kvstore.codecs import fast_kchan, fast_rotated, fast_t0  # noqa: E402

LAYOUT = KVLayout(model="test/warm-up", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=32, layout="kv,layer,token,head,dim")   # 32 KiB blocks
SMALL = KVLayout(model="test/warm-up-small", num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                 block_tokens=32)                                     # 8 KiB blocks
chain = functools.partial(codec_blocks.chain, LAYOUT)
LOSSY = [name for name, cid in CODEC_IDS.items() if codecs.get_codec(cid).lossy]

#: seconds of small puts timed while the child compiles
WINDOW_S = 8.0
#: the p99 of small puts into the daemon whose kernels compile is at most this many times that of
#: puts into a quiet daemon, taken in turn in the same seconds (the same load on the host), plus
#: SLACK_S: generous, since the child takes one of the host's cores. Compiling in the daemon's own
#: thread (numba holds the GIL through most of its ~30 s of CPU) made it 4-7x its own p99 once
#: loaded (30-35 ms against 5-9 ms, load 4-7 on 2 cores); at load 12-20 host noise hides that, and
#: what fails the old code is the daemon's CPU per put (4.5 ms against the quiet daemon's 1.45 ms).
#: Measured now: 13.0 / 13.6 ms (load 12.4), 28.0 / 25.9 ms (20.8), 49.1 / 25.3 ms (16.7).
P99_RATIO, SLACK_S = 3.0, 0.010


def reference(codec: str, raw: np.ndarray, monkeypatch) -> bytes:
    """What the torch reference decodes a block encoded by ``codec`` to (in this process)."""
    import kvstore.codecs.base as base
    monkeypatch.setattr(base, "USE_FAST", False)
    try:
        codec_id, payload = encode_block(codec, raw, LAYOUT)
        return decode_block(codec_id, payload, LAYOUT).numpy().tobytes()
    finally:
        monkeypatch.setattr(base, "USE_FAST", True)


def put_latencies(clients: list, seconds: float, until) -> list[list[float]]:
    """Single-block raw puts of fresh 8 KiB blocks into each of ``clients`` ((client, namespace))
    in turn, for ``seconds`` or until ``until()``: each one's latencies."""
    rng = np.random.default_rng(1)
    took: list[list[float]] = [[] for _ in clients]
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        for (c, ns), out in zip(clients, took):
            block = rng.integers(0, 255, SMALL.block_bytes, dtype=np.uint8)
            t0 = time.monotonic()
            assert c.put(ns, [rng.bytes(16)], [block]) == ["stored"]
            out.append(time.monotonic() - t0)
    return took


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system   # (the daemon's own threads: not its children's)


def maps(pid: int, *names: str) -> set[str]:
    """Which of ``names`` a file the process maps has in its path (a shared library it loaded)."""
    with open(f"/proc/{pid}/maps") as f:
        text = f.read()
    return {n for n in names if n in text}


def kernels_ready(d) -> bool:
    return "codec kernels ready" in d.log()


def wait_until(what, timeout_s: float, d) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.2)


def test_small_puts_stay_fast_while_the_kernels_compile_in_a_child(tmp_path, monkeypatch):
    cache = tmp_path / "numba-cache"
    config = tmp_path / "kvstore.yaml"
    config.write_text(f"shm_dir: {tmp_path}\n")   # no tier codecs: client-encoded blocks are decoded
    d = start_local_daemon(tmp_path / "d", "--config", str(config), cpu_bytes="32MiB", nvme_bytes="64MiB",
                           env={"NUMBA_CACHE_DIR": str(cache)})
    quiet = start_local_daemon(tmp_path / "quiet", "--shm-dir", str(tmp_path), cpu_bytes="32MiB",
                               nvme_bytes="64MiB")
    wait_codecs_warm(quiet)
    procs = [psutil.Process(d.pid), psutil.Process(quiet.pid)]
    try:
        with d.client(timeout_s=30) as c, quiet.client(timeout_s=30) as q:
            pairs = [(c, c.register_namespace(Namespace(SMALL))), (q, q.register_namespace(Namespace(SMALL)))]
            ns = c.register_namespace(Namespace(LAYOUT))
            assert not maps(d.pid, "libtorch", "llvmlite")   # nothing of the codecs' imports yet
            # the first lossy put starts the warm-up (the torch reference decodes it meanwhile)
            hashes, blocks = chain(1, seed=90)
            assert c.put(ns, hashes, blocks, encode=LOSSY[0]) == ["stored"]
            child = int(re.search(r"codec kernels: compiling in child process (\d+)", d.log()).group(1))
            assert psutil.Process(child).ppid() == d.pid
            cpu0 = [cpu_s(p) for p in procs]
            compiling, quiet_puts = put_latencies(pairs, WINDOW_S, until=lambda: kernels_ready(d))
            cpu = [(cpu_s(p) - t) / len(compiling) for p, t in zip(procs, cpu0)]
            assert not kernels_ready(d), "the kernels compiled in under WINDOW_S: nothing was measured"
            print(f"{len(compiling)} small puts each: while compiling p50 {np.median(compiling) * 1e3:.2f} ms "
                  f"p99 {p99(compiling) * 1e3:.2f} ms, {cpu[0] * 1e3:.2f} ms of daemon CPU per put; quiet "
                  f"p50 {np.median(quiet_puts) * 1e3:.2f} ms p99 {p99(quiet_puts) * 1e3:.2f} ms, "
                  f"{cpu[1] * 1e3:.2f} ms; load {os.getloadavg()[0]:.1f}")
            assert p99(compiling) <= P99_RATIO * p99(quiet_puts) + SLACK_S
            # the compile's CPU is the child's: the daemon spends per put about what the quiet one does
            assert cpu[0] <= 2 * cpu[1] + 0.001
            wait_until(lambda: kernels_ready(d), 600, d)
            compiled_names = {p.name.split(".")[1].rsplit("-", 1)[0] for p in cache.rglob("*.nbi")}
            kernels = (fast_cpu, fast_rotated, fast_kchan, fast_t0)
            assert compiled_names == {name for m in kernels for name in m.KERNEL_NAMES}
            assert "loaded from numba's cache" in d.log()   # not compiled a second time, in the daemon
            # every lossy codec, now decoded by the loaded kernels: the torch reference's bytes
            hashes, blocks = chain(len(LOSSY), seed=91)
            for codec, h, block in zip(LOSSY, hashes, blocks):
                assert c.put(ns, [h], [block], encode=codec) == ["stored"], codec
            assert c.get(ns, hashes) == [reference(codec, b, monkeypatch) for codec, b in zip(LOSSY, blocks)]
    finally:
        assert quiet.stop() == 0
        assert d.stop() == 0


def test_a_failed_child_leaves_the_compile_to_the_daemon_which_says_so_once(tmp_path, monkeypatch):
    """The child killed (the OOM killer, an operator): the daemon compiles (or loads) the kernels
    itself, as it would without a child, logs that once, and decodes as the reference does."""
    config = tmp_path / "kvstore.yaml"
    config.write_text(f"shm_dir: {tmp_path}\n")
    d = start_local_daemon(tmp_path / "d", "--config", str(config), cpu_bytes="8MiB", nvme_bytes="64MiB")
    try:
        with d.client(timeout_s=30) as c:
            ns = c.register_namespace(Namespace(LAYOUT))
            hashes, blocks = chain(len(LOSSY), seed=92)
            assert c.put(ns, hashes[:1], blocks[:1], encode=LOSSY[0]) == ["stored"]
            child = int(re.search(r"codec kernels: compiling in child process (\d+)", d.log()).group(1))
            psutil.Process(child).kill()   # (it imports torch first: seconds, on any host)
            wait_until(lambda: kernels_ready(d), 600, d)
            assert d.log().count("the child process compiling them failed (exit -9") == 1
            for codec, h, block in zip(LOSSY[1:], hashes[1:], blocks[1:]):
                assert c.put(ns, [h], [block], encode=codec) == ["stored"], codec
            assert c.get(ns, hashes) == [reference(codec, b, monkeypatch) for codec, b in zip(LOSSY, blocks)]
    finally:
        assert d.stop() == 0

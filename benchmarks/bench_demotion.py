#!/usr/bin/env python3
"""Gets of hot blocks while another client's puts push the CPU tier's victims down to NVMe;
writes benchmarks/results/demotion.{json,md}.

    .venv/bin/python benchmarks/bench_demotion.py [--seconds 8] [--dir /var/tmp]

A cache is full most of its life, so most puts demote a victim to disk first. This measures what
that costs everyone else: a reader in this process gets a few hot blocks (CPU-resident) over
shared memory, one call every 2 ms, timing each; a writer in another process puts fresh blocks
as fast as it can. Three phases, one daemon: *quiet* (no writer), *puts that fit* (the writer
deletes each batch after putting it, so nothing is demoted: the same put traffic without the
disk) and *puts that demote* (the writer keeps its blocks, so every block it puts demotes one).
The figure to read: the reader's p50 / p99 with demoting puts divided by those with puts that
fit, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore.client import Client
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, write_report
from kvstore.service.gc_pauses import GcPauses

HERE = os.path.dirname(os.path.abspath(__file__))
HOT_BLOCKS = 4
BATCH = 8
READ_EVERY_S = 0.002
PHASES = ("quiet", "puts that fit", "puts that demote")

WRITER = """
import sys, time, numpy as np
from kvstore.client import Client
from kvstore.keys import ChainHasher, KVLayout, Namespace
url, block, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keep, seconds = sys.argv[4] == "keep", float(sys.argv[5])
lay = KVLayout(model="bench/demotion", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
               block_bytes=block)
blocks = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(batch)]
with Client(url, timeout_s=60) as c:
    ns = c.register_namespace(Namespace(lay))
    print("ready", flush=True)
    stop, n, r = time.monotonic() + seconds, 0, 0
    while time.monotonic() < stop:
        r += 1
        hashes = ChainHasher(seed=1000 + r + (10**6 if keep else 0)).chain(np.arange(batch * 16), 16)
        assert c.put(ns, hashes, blocks) == ["stored"] * batch
        if not keep:
            c.delete(ns, hashes)
        n += batch
    print(n, flush=True)
"""


def layout(block: int) -> KVLayout:
    return KVLayout(model="bench/demotion", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                    block_tokens=16, block_bytes=block)


def percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"gets": len(s), "p50_us": round(s[len(s) // 2] * 1e6), "p99_us": round(s[int(len(s) * 0.99)] * 1e6),
            "max_us": round(s[-1] * 1e6)}


def read_hot(client: Client, ns: bytes, hashes: list[bytes], want: list[np.ndarray], seconds: float) -> dict:
    outs = [np.zeros_like(w) for w in want]
    lat = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        t = time.perf_counter()
        got = client.get_into(ns, hashes, outs)
        lat.append(time.perf_counter() - t)
        if got != [w.nbytes for w in want] or not all(np.array_equal(o, w) for o, w in zip(outs, want)):
            raise RuntimeError("a hot block was missed or served wrong")
        time.sleep(READ_EVERY_S)
    return percentiles(lat)


def phase(d, client: Client, ns: bytes, hot: list[bytes], want, block: int, writer: str | None,
          seconds: float) -> dict:
    before = client.stats()["counters"]
    proc = None
    if writer is not None:
        proc = subprocess.Popen([sys.executable, "-c", WRITER, d.address, str(block), str(BATCH), writer,
                                 str(seconds + 1.5)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)   # the writer is putting (and, keeping its blocks, filling the tier) by now
    out = read_hot(client, ns, hot, want, seconds)
    if proc is not None:
        blocks = int(proc.stdout.readline())
        if proc.wait(60):
            raise RuntimeError("the writer failed")
        out["writer_blocks_per_s"] = round(blocks / (seconds + 1.5))
    after = client.stats()["counters"]
    for name in ("demotions", "demotions_outside_lock", "demotion_failures"):
        out[name] = after.get(name, 0) - before.get(name, 0)
    return out


def run(block: int, cpu_bytes: int, seconds: float, directory: str) -> dict:
    work = tempfile.mkdtemp(prefix="bench-demotion-", dir=directory)
    d = start_local_daemon(work, "--log-level", "WARNING", "--cpu-slot-bytes", str(block),
                           cpu_bytes=str(cpu_bytes), nvme_bytes=str(64 * cpu_bytes))
    try:
        with Client(d.address) as client:
            ns = client.register_namespace(Namespace(layout(block)))
            hot = ChainHasher(seed=1).chain(np.arange(HOT_BLOCKS * 16), 16)
            want = [np.random.default_rng(100 + i).integers(0, 256, block, dtype=np.uint8) for i in range(HOT_BLOCKS)]
            assert client.put(ns, hot, want) == ["stored"] * HOT_BLOCKS
            # the reader's own collector stops it too: out of the way like the daemon's, and counted
            reader_gc = GcPauses()
            reader_gc.install()
            reader_gc.freeze_startup_objects()
            try:
                out = {name: phase(d, client, ns, hot, want, block, writer, seconds)
                       for name, writer in zip(PHASES, (None, "delete", "keep"))}
            finally:
                reader_gc.uninstall()
                gc.unfreeze()
            out["reader_full_collections"] = reader_gc.stats()["generations"]["2"]
            # the daemon's full collections pause every request: the reader's largest waits may be these
            out["daemon_full_collections"] = client.stats()["server"].get("gc", {}).get("generations", {}).get("2")
            return out
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    m = r["machine"]
    out = ["# Gets while puts demote to NVMe (benchmarks/bench_demotion.py)", "",
           machine_line(m) + (f"; kvstore at {r['commit']}" if "commit" in r else "") + ". One daemon per block size (CPU tier "
           f"{r['cpu_mib']} MiB in slots of one block, NVMe tier in {r['dir']}). The reader (this process) gets "
           f"{HOT_BLOCKS} hot CPU-resident blocks over shared memory every {READ_EVERY_S * 1e3:.0f} ms for "
           f"{r['seconds']} s a phase; the writer (another process) puts {BATCH} fresh blocks per call back to back, "
           "deleting them after each call (*puts that fit*: no demotion) or keeping them (*puts that demote*: the "
           "CPU tier is full, so each block it puts first pushes a victim down to NVMe).", "",
           "| block | phase | reader gets | p50 us | p99 us | max us | writer blocks/s | demotions "
           "| of them outside the lock |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size, phases in r["sizes"].items():
        for name in PHASES:
            v = phases[name]
            out.append(f"| {size} | {name} | {v['gets']} | {v['p50_us']} | {v['p99_us']} | {v['max_us']} | "
                       f"{v.get('writer_blocks_per_s', '-')} | {v['demotions']} | {v['demotions_outside_lock']} |")
    out += ["", "Reader's latency with demoting puts / with puts that fit (same run; 1.0 = demotion costs "
                "the reader nothing beyond the put traffic itself):", ""]
    for size, phases in r["sizes"].items():
        fit, dem = phases["puts that fit"], phases["puts that demote"]
        out.append(f"- {size}: p50 {dem['p50_us'] / fit['p50_us']:.2f}x, p99 {dem['p99_us'] / fit['p99_us']:.2f}x")
    for who in ("daemon", "reader"):
        full = {size: p[f"{who}_full_collections"] for size, p in r["sizes"].items() if p.get(f"{who}_full_collections")}
        if full:
            out += ["", f"The {who}'s full garbage collections over all three phases (every thread of it stands still "
                        "meanwhile; objects made before the phases are kept out of them, gc.freeze): "
                    + "; ".join(f"{size}: {g['collections']}, the longest {g['pause_max_ms']:.1f} ms"
                                for size, g in full.items()) + "."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="reader time per phase")
    ap.add_argument("--dir", default="/var/tmp", help="where the NVMe tier goes (a real disk, not tmpfs)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "demotion"))
    a = ap.parse_args()
    sizes = {"1MiB": (1 << 20, 64 << 20), "64KiB": (64 << 10, 16 << 20)}
    report = {"machine": machine_facts(), "seconds": a.seconds, "dir": a.dir,
              "cpu_mib": {k: v[1] >> 20 for k, v in sizes.items()}, "sizes": {}}
    for name, (block, cpu_bytes) in sizes.items():
        report["sizes"][name] = run(block, cpu_bytes, a.seconds, a.dir)
    report["cpu_mib"] = " / ".join(f"{v} ({k} blocks)" for k, v in report["cpu_mib"].items())
    write_report(a.out, report, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

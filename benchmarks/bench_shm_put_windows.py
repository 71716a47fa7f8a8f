#!/usr/bin/env python3
"""Same-host puts in windows of store leases against one lease per put, in one run; writes
benchmarks/results/shm_put_windows.{json,md}.

    .venv/bin/python benchmarks/bench_shm_put_windows.py [--sizes 64KiB,1MiB] [--total 256MiB] [--reps 8]

One private daemon (kvstore.ops.local_daemon, CPU arena only, default slots) and one
shared-memory client. A windowed put (``shm_path.put_windows``: 128 blocks, doubling to 1024,
the next lease prepared while the current window is copied) and the same put as one lease (what
every put was before: ``FIRST_WINDOW_BLOCKS`` raised past the batch) alternate pass by pass
(A B B A ...), each pass of fresh hashes right after one memcpy pass into a working set as large
as the data moved (kvstore.ops.ceilings.MemcpyPass); figures are medians, ratios per pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from kvstore.client import shm_path
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops.ceilings import GB, MemcpyPass, touched_buffer
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, write_report
from kvstore.units import format_size, parse_size
from kvstore.wire import MAX_BATCH

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOWED = shm_path.FIRST_WINDOW_BLOCKS


def run(sizes: list[int], total: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-put-windows-", ignore_cleanup_errors=True) as work:
        cpu = str(max(total // s * -(-s // (256 << 10)) * (256 << 10) for s in sizes) + (256 << 20))
        daemon = start_local_daemon(os.path.join(work, "kvd"), "--log-level", "WARNING", cpu_bytes=cpu, nvme_bytes="0")
        report = {"machine": machine_facts(), "total_bytes": total, "reps": reps, "sizes": {}}
        try:
            with daemon.client(transport="shm", timeout_s=120) as c:
                for size in sizes:
                    count = min(MAX_BATCH, total // size)
                    ns = c.register_namespace(Namespace(KVLayout(
                        model="bench/put-windows", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                        block_tokens=16, block_bytes=size), cache_salt="windows"))
                    src = np.frombuffer(touched_buffer(size * count), dtype=np.uint8)
                    blocks = [src[i * size:(i + 1) * size] for i in range(count)]
                    memcpy = MemcpyPass(size, working_set=size * count)
                    runs: dict[str, list] = {"windowed": [], "one lease": []}
                    ratios: dict[str, list] = {"windowed": [], "one lease": []}
                    order = ["windowed", "one lease", "one lease", "windowed"] * reps
                    for r, mode in enumerate(["windowed", "one lease"] + order):   # the first two warm up
                        shm_path.FIRST_WINDOW_BLOCKS = WINDOWED if mode == "windowed" else MAX_BATCH
                        hashes = ChainHasher(seed=r).chain(np.arange(16 * count) + (r + 1) * 7_000_003, 16)
                        ceiling = memcpy.bytes / memcpy() / GB
                        t = time.perf_counter()
                        assert c.put(ns, hashes, blocks) == ["stored"] * count
                        gbps = size * count / (time.perf_counter() - t) / GB
                        c.delete(ns, hashes)
                        if r >= 2:
                            runs[mode].append(gbps)
                            ratios[mode].append(gbps / ceiling)
                    shm_path.FIRST_WINDOW_BLOCKS = WINDOWED
                    row = {"count": count, "windows": len(shm_path.put_windows(count))}
                    for mode in runs:
                        row[mode] = {"put_gbps": statistics.median(runs[mode]), "runs": runs[mode],
                                     "put_vs_memcpy": statistics.median(ratios[mode])}
                    report["sizes"][format_size(size)] = row
        finally:
            shm_path.FIRST_WINDOW_BLOCKS = WINDOWED
            daemon.stop()
    report["load_average_end"] = os.getloadavg()[0]
    return report


def markdown(r: dict) -> str:
    m = r["machine"]
    rows = "\n".join(
        f"| {label} | {row['count']} | {row['windows']} | {row['windowed']['put_gbps']:.2f} "
        f"({row['windowed']['put_vs_memcpy']:.2f}x) | {row['one lease']['put_gbps']:.2f} "
        f"({row['one lease']['put_vs_memcpy']:.2f}x) | "
        f"{row['windowed']['put_gbps'] / row['one lease']['put_gbps']:.2f}x |"
        for label, row in r["sizes"].items())
    return f"""# Same-host puts: windows of store leases vs one lease (benchmarks/bench_shm_put_windows.py)

{machine_line(m, load=(m.get('load_avg_1m'), r['load_average_end']))}; {m.get('time_utc')}. One private daemon (CPU arena only, 256 KiB slots), one shared-memory client; {format_size(r['total_bytes'])} per put, one put call per pass; the two modes alternate pass by pass (A B B A, {r['reps']} rounds), each pass right after a memcpy pass into a working set as large as the data moved. GB/s = 1e9 bytes/s, medians; in brackets the median per-pass ratio to that memcpy.

| block | blocks per put | windows | windowed put GB/s (x memcpy) | one lease GB/s (x memcpy) | windowed / one lease |
|---|---|---|---|---|---|
{rows}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64KiB,1MiB")
    ap.add_argument("--total", default="256MiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "shm_put_windows"))
    a = ap.parse_args()
    sizes = [parse_size(s, "sizes") for s in a.sizes.split(",")]
    write_report(a.out, run(sizes, parse_size(a.total, "total"), a.reps), markdown)


if __name__ == "__main__":
    main()

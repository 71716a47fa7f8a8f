#!/usr/bin/env python3
"""The daemon's data paths against ceilings measured in the same run; writes
benchmarks/results/service.{json,md}.

    .venv/bin/python benchmarks/bench_service.py [--url HOST:PORT] [--sizes 64KiB,1MiB,4MiB,16MiB] [--total 256MiB]

Measures put/get GB/s for 64 KiB and 1/4/16 MiB blocks over gRPC streams, the raw-TCP bulk side channel and
shared memory; small same-host requests (16 x 64 KiB, 4 x 1 MiB per call, lease calls over the daemon's Unix
socket and over gRPC); lookups per second (one chain per RPC, and batched); memcpy and a raw TCP loopback
socket as ceilings, each ceiling pass interleaved with the pass it judges (memcpy: kvstore.ops.ceilings
MemcpyPass into a working set as large as the data moved; TCP: kvstore.ops.ceilings.TcpPass, a persistent
connection between distinct source and destination buffers as large as the data moved); Redis at 127.0.0.1:6379 as a peer on the same
workload. Goals (issue 3): shm get >= 0.7x memcpy; remote get/put >= 0.8x raw TCP; lookups >= 10k/s.
Without --url a private daemon runs as a child process (kvstore.ops.local_daemon). Re-executes itself with the
glibc malloc settings `kvstore serve` uses, so client and daemon are tuned alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from kvstore.buffers import COPY_PART_BYTES
from kvstore.client.shm_path import PARALLEL_PUT_BLOCK_BYTES
from kvstore.ops.report import machine_line, write_report

HERE = os.path.dirname(os.path.abspath(__file__))

GOALS = {"shm_get_vs_memcpy": 0.7, "bulk_get_vs_tcp": 0.8, "bulk_put_vs_tcp": 0.8, "lookups_per_s": 10_000}


def markdown(report: dict) -> str:
    m = report["machine"]
    out = ["# Service benchmark (benchmarks/bench_service.py)", "",
           machine_line(m, "grpcio", "numpy") + f" (shared machine: read ratios, not absolutes). Daemon: {report['daemon']}. "
           f"Medians of {report['reps']} repetitions of {report['total_bytes_per_measurement'] >> 20} MiB each. "
           f"GB = 1e9 bytes. Ratios are medians of per-pass ratios, each service pass timed right after a "
           f"ceiling pass (memcpy, and one TCP loopback stream, each between distinct buffers as large as the data "
           f"moved, as the service's reads and writes are; for shm gets the memcpy's sources span as many bytes as "
           f"its destinations, so neither side is in the caches, as when blocks are read out of an arena larger "
           f"than the caches; shm puts copy from 8 pooled blocks, as the benchmark's own sources are); "
           f"the ceiling columns are medians measured at the end, for scale.", "",
           "| block | path | put GB/s | get GB/s | put ceiling GB/s | get ceiling GB/s | get / ceiling | put / ceiling |",
           "|---|---|---|---|---|---|---|---|"]
    for size, row in report["sizes"].items():
        mib = f"{int(size) >> 20} MiB" if int(size) >= 1 << 20 else f"{int(size) >> 10} KiB"
        for t in ("shm", "bulk", "grpc", "redis"):
            r = row.get(t)
            if not r:
                continue
            ceiling = row["memcpy_gbps"] if t == "shm" else row["tcp_gbps"]
            get_ceiling = row.get("memcpy_cold_gbps", ceiling) if t == "shm" else ceiling
            name = {"shm": "memcpy"}.get(t, "raw TCP")
            get_r = r.get("get_vs_ceiling", r["get_gbps"] / get_ceiling)
            put_r = r.get("put_vs_ceiling", r["put_gbps"] / ceiling)
            cold = " (cold)" if t == "shm" and "memcpy_cold_gbps" in row else ""
            out.append(f"| {mib} | {t} | {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | {name} {ceiling:.2f} | "
                       f"{name}{cold} {get_ceiling:.2f} | {get_r:.2f}x | {put_r:.2f}x |")
    several = [(size, row) for size, row in report["sizes"].items() if "memcpy_cold_threads_gbps" in row and "shm" in row]
    if several:
        n = several[0][1]["copy_threads"]
        out += ["", f"The shm path copies a run of {2 * COPY_PART_BYTES >> 20} MiB or more (puts: in blocks of "
                    f"{PARALLEL_PUT_BLOCK_BYTES >> 10} KiB or more) on {n} threads "
                    f"(`kvstore.buffers.copy_each`), so the table's one-thread memcpy is not the most this machine "
                    f"can copy. The same cold memcpy split over {n} threads, medians of 3 passes at the end:", "",
                f"| block | shm put / get GB/s | memcpy (cold), {n} threads GB/s | put / it | get / it |",
                "|---|---|---|---|---|"]
        for size, row in several:
            mib = f"{int(size) >> 20} MiB" if int(size) >= 1 << 20 else f"{int(size) >> 10} KiB"
            ceil = row["memcpy_cold_threads_gbps"]
            out.append(f"| {mib} | {row['shm']['put_gbps']:.2f} / {row['shm']['get_gbps']:.2f} | {ceil:.2f} | "
                       f"{row['shm']['put_gbps'] / ceil:.2f}x | {row['shm']['get_gbps'] / ceil:.2f}x |")
    grpcio = [(size, row) for size, row in report["sizes"].items() if "grpcio_up_gbps" in row]
    if grpcio:
        out += ["", "The gRPC fallback against grpcio's own stream (`kvstore.ops.grpc_ceiling`: a plain grpc.aio server "
                    "process and a sync client moving 1 MiB bytes messages, the chunks the fallback sends, with no "
                    "work at either end; medians of 3 passes after the kvstore passes):", "",
                "| block | grpc put / get GB/s | grpcio stream up / down GB/s | put / grpcio | get / grpcio |",
                "|---|---|---|---|---|"]
        for size, row in grpcio:
            mib = f"{int(size) >> 20} MiB" if int(size) >= 1 << 20 else f"{int(size) >> 10} KiB"
            out.append(f"| {mib} | {row['grpc']['put_gbps']:.2f} / {row['grpc']['get_gbps']:.2f} | "
                       f"{row['grpcio_up_gbps']:.2f} / {row['grpcio_down_gbps']:.2f} | "
                       f"{row['grpc_put_vs_grpcio']:.2f}x | {row['grpc_get_vs_grpcio']:.2f}x |")
    lk = report.get("lookups")
    if lk:
        out += ["", f"Lookups (4-block chain, metadata only): {lk['sequential_per_s']:,.0f}/s with one chain per RPC, "
                    f"{lk['batched_per_s']:,.0f}/s batched ({lk['batch']} chains per LookupBatch RPC)."]
    small = report.get("small_requests")
    if small:
        r0 = small[0]
        out += ["", f"Small same-host requests (one request's blocks per call, as a connector loads or saves them each "
                    f"step): median call over {r0['calls']} calls, median of {r0['rounds']} rounds alternating a "
                    f"client making its lease calls over the daemon's Unix socket with one making them over gRPC "
                    f"(`Client(local_leases=False)`); memcpy = the same bytes between buffers larger than the caches; "
                    f"x memcpy = memcpy time / call time.", "",
                "| request | lease calls | put ms | get ms | memcpy ms | put x memcpy | get x memcpy |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for r in small:
            shape = f"{r['blocks']} x {r['block_bytes'] >> 10} KiB" if r["block_bytes"] < 1 << 20 else \
                f"{r['blocks']} x {r['block_bytes'] >> 20} MiB"
            for way, label in (("socket", "Unix socket"), ("grpc", "gRPC")):
                out.append(f"| {shape} | {label} | {r[f'{way}_put_ms']:.2f} | {r[f'{way}_get_ms']:.2f} | "
                           f"{r['memcpy_ms']:.2f} | {r[f'{way}_put_vs_memcpy']:.2f}x | {r[f'{way}_get_vs_memcpy']:.2f}x |")
    out += ["", "## Goals", "", "| goal | target | measured (worst block size) | met |", "|---|---|---|---|"]
    for goal, target in report["goals"].items():
        out.append(f"| {goal} | >= {target['target']} | {target['measured']:.2f} | {'yes' if target['met'] else 'no'} |")
    out += ["", "Paths: `shm` = same-host client maps the daemon's CPU arena (PrepareLoad/PrepareStore leases); "
                "`bulk` = raw TCP side channel negotiated over gRPC (control on gRPC); `grpc` = pure gRPC "
                "streams of chunks of up to 1 MiB, smaller blocks packed several to a chunk (fallback); `redis` = Redis 127.0.0.1:6379 SET/GET pipelined, "
                "redis-py + hiredis, the same blocks."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB")
    ap.add_argument("--total", default="256MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "service"))
    args = ap.parse_args()
    from kvstore.ops.cli import reexec_with_malloc_tuning

    reexec_with_malloc_tuning(sys.argv)
    from kvstore.ops.bench import format_report, run_bench
    from kvstore.units import parse_size

    t0 = time.time()
    report = run_bench(url=args.url, sizes=[parse_size(s, "sizes") for s in args.sizes.split(",")],
                       total_bytes=parse_size(args.total, "total"), reps=args.reps, small=True)
    report["seconds"] = round(time.time() - t0, 1)
    rows = report["sizes"].values()

    def worst(key: str) -> float:
        vals = [r[key] for r in rows if key in r]
        return min(vals) if vals else 0.0

    measured = {"shm_get_vs_memcpy": worst("shm_get_vs_memcpy"), "bulk_get_vs_tcp": worst("bulk_get_vs_tcp"),
                "bulk_put_vs_tcp": worst("bulk_put_vs_tcp"),
                "lookups_per_s": report.get("lookups", {}).get("batched_per_s", 0.0)}
    report["goals"] = {k: {"target": GOALS[k], "measured": v, "met": v >= GOALS[k]} for k, v in measured.items()}
    write_report(args.out, report, markdown, echo=False)
    print(format_report(report))
    print(f"\nwrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

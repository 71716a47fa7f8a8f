#!/usr/bin/env python3
"""What authentication costs the same-host path: shared-memory put/get GB/s with auth off (one
arena file) and on (tenant segments handed out by descriptor), in one run; writes
benchmarks/results/shm_auth.{json,md}.

    .venv/bin/python benchmarks/bench_shm_auth.py [--sizes 1MiB,4MiB,16MiB] [--total 128MiB] [--reps 3]

Two private daemons (kvstore.ops.local_daemon) with equal tiers; the second has two tenants'
tokens, so its CPU arena is tenant segments (cpu_segment_bytes at its default, cpu_bytes / 64).
For each block size the two are measured one after the other, each pass right after a memcpy
pass into a working set as large as the data moved (kvstore.ops.ceilings.MemcpyPass), with
kvstore.ops.bench.service_gbps. Goal (issue 17): auth on no longer costs the shm path.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace
from kvstore.ops.bench import service_gbps
from kvstore.ops.ceilings import MemcpyPass
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.units import parse_size
from kvstore.ops.report import machine_line, write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def run(sizes: list[int], total: int, reps: int) -> dict:
    cpu = str(max(sizes) * 8 + 2 * total + (64 << 20))
    common = ("--cpu-slot-bytes", "1MiB", "--log-level", "WARNING")
    report = {"machine": machine_facts(), "total_bytes_per_measurement": total, "reps": reps, "cpu_bytes": int(cpu),
              "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="kvstore-shm-auth-", ignore_cleanup_errors=True) as workdir:
        daemons = {
            "auth off": (start_local_daemon(os.path.join(workdir, "open"), *common, nvme_bytes="0", cpu_bytes=cpu),
                         None),
            "auth on": (start_local_daemon(os.path.join(workdir, "auth"), *common, "--token", "alice-token=alice",
                                           "--token", "bob-token=bob", nvme_bytes="0", cpu_bytes=cpu), "alice-token"),
        }
        try:
            clients = {name: Client(d.address, token=token, transport="shm", timeout_s=60)
                       for name, (d, token) in daemons.items()}
            for size in sizes:
                count = max(2, total // size)
                layout = KVLayout(model="bench/shm-auth", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                                  block_tokens=16, block_bytes=size)
                memcpy = MemcpyPass(size, working_set=size * count)
                row = {}
                for name, c in clients.items():
                    ns = c.register_namespace(Namespace(layout))
                    row[name] = service_gbps(c, ns, size, count, reps, tag=name, ceiling=memcpy)
                row["on_vs_off_get"] = row["auth on"]["get_gbps"] / row["auth off"]["get_gbps"]
                row["on_vs_off_put"] = row["auth on"]["put_gbps"] / row["auth off"]["put_gbps"]
                report["sizes"][str(size)] = row
            for c in clients.values():
                c.close()
        finally:
            for d, _ in daemons.values():
                d.stop(timeout=30)
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    out = ["# Shared memory with auth off and on (benchmarks/bench_shm_auth.py)", "",
           machine_line(m) + ". Two private daemons with a "
           f"{report['cpu_bytes'] >> 20} MiB CPU tier; with auth on it is tenant segments of cpu_bytes / 64. "
           f"Medians of {report['reps']} repetitions of {report['total_bytes_per_measurement'] >> 20} MiB; GB = 1e9 "
           "bytes; each pass right after a memcpy pass into a working set as large as the data moved.", "",
           "| block | auth | put GB/s | get GB/s | get / memcpy | put / memcpy |", "|---|---|---|---|---|---|"]
    for size, row in report["sizes"].items():
        for name in ("auth off", "auth on"):
            r = row[name]
            out.append(f"| {int(size) >> 20} MiB | {name} | {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | "
                       f"{r['get_vs_ceiling']:.2f}x | {r['put_vs_ceiling']:.2f}x |")
    out += ["", "| block | get: on / off | put: on / off | bytes verified |", "|---|---|---|---|"]
    for size, row in report["sizes"].items():
        ok = row["auth on"]["verified"] and row["auth off"]["verified"]
        out.append(f"| {int(size) >> 20} MiB | {row['on_vs_off_get']:.2f}x | {row['on_vs_off_put']:.2f}x | {ok} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB")
    ap.add_argument("--total", default="128MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "shm_auth"))
    a = ap.parse_args()
    report = run([parse_size(s) for s in a.sizes.split(",")], parse_size(a.total), a.reps)
    write_report(a.out, report, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

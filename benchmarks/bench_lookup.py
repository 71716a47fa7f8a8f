#!/usr/bin/env python3
"""Scheduler-path lookups: a 128-block chain looked up by a same-host client, over the daemon's
Unix socket and over gRPC, on an idle daemon and while it serves a 64-client load; writes
benchmarks/results/lookup.{json,md}.

    .venv/bin/python benchmarks/bench_lookup.py [--lookups 2000] [--clients 64]

An engine's scheduler asks once per request, hit or miss, before it schedules anything, so this
latency is paid by every request. The load: ``--clients`` threads in a separate process, each with
its own client getting 1 MiB blocks over shared memory in a loop. Goal (issue 14): p50 <= 100 us
and p99 <= 500 us under that load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore.client import Client, Lookup
from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, write_report

FLOOR = "in-process dict (floor)"
SPIN = "spin of the index's idle p50"
HERE = os.path.dirname(os.path.abspath(__file__))
LOOKUP = KVLayout(model="bench/lookup", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
                  block_bytes=4096)
LOAD = KVLayout(model="bench/lookup-load", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
                block_bytes=1 << 20)
LOAD_SCRIPT = """
import sys, threading, time, numpy as np
from kvstore.client import Client
from kvstore.keys import ChainHasher, KVLayout, Namespace
url, clients, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
lay = KVLayout(model="bench/lookup-load", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
               block_bytes=1 << 20)
with Client(url) as c:
    ns = c.register_namespace(Namespace(lay))
    hs = ChainHasher(seed=99).chain(np.arange(8 * 16), 16)
    c.put(ns, hs, [np.ones(1 << 20, np.uint8)] * 8)
stop = time.monotonic() + seconds
done = [0]
def work():
    with Client(url, timeout_s=30) as c:
        c.register_namespace(Namespace(lay))
        out = [np.empty(1 << 20, np.uint8) for _ in range(2)]
        while time.monotonic() < stop:
            c.get_into(ns, hs[:2], out)
            done[0] += 1
threads = [threading.Thread(target=work) for _ in range(clients)]
print("ready", flush=True)
for t in threads: t.start()
for t in threads: t.join()
print("gets", done[0], flush=True)
"""


class InProcessDict:
    """The floor: an engine's own prefix cache, a dict walked in its own process (nothing shared,
    no daemon). Timed like the others, so under load its tail is what the host's scheduler alone
    costs a lookup on this machine."""

    def __init__(self, hashes: list[bytes]) -> None:
        self._tiers = dict.fromkeys(hashes, "cpu")

    def lookup(self, ns: bytes, hashes: list[bytes]) -> Lookup:
        tiers = []
        for h in hashes:
            tier = self._tiers.get(h)
            if tier is None:
                break
            tiers.append(tier)
        return Lookup(len(tiers), tiers)


class Spin:
    """The host's own tail for a lookup's length of work: a busy wait of ``seconds`` (the mapped
    index's idle p50), timed like the others. Preempted mid-wait, it ends late, as a lookup would."""

    def __init__(self, seconds: float, blocks: int) -> None:
        self.seconds, self._answer = seconds, Lookup(blocks, ["cpu"] * blocks)

    def lookup(self, ns: bytes, hashes: list[bytes]) -> Lookup:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self._answer


def percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_us": round(s[len(s) // 2] * 1e6, 1), "p99_us": round(s[int(len(s) * 0.99)] * 1e6, 1),
            "mean_us": round(statistics.fmean(s) * 1e6, 1)}


def timed(client: Client, ns: bytes, hashes: list[bytes], n: int, interval_s: float = 0.0) -> dict:
    """``n`` lookups, back to back or one every ``interval_s`` (a scheduler asks once per arriving
    request; back to back, an index-answered lookup's note to the daemon outpaces it)."""
    lat = []
    start = time.perf_counter()
    for i in range(n):
        if interval_s:
            wait = start + i * interval_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        t = time.perf_counter()
        assert client.lookup(ns, hashes).num_hit == len(hashes)
        lat.append(time.perf_counter() - t)
    return percentiles(lat)


def measured(paths: dict, remote: Client, ns: bytes, hashes: list[bytes], lookups: int, interval_s: float) -> dict:
    out = {name: timed(c, ns, hashes, lookups) for name, c in paths.items()}
    out.update({f"{name}, 1 per {interval_s * 1e6:.0f} us": timed(c, ns, hashes, lookups, interval_s)
                for name, c in paths.items()})
    out["grpc"] = timed(remote, ns, hashes, lookups // 4)
    return out


def run(lookups: int, clients: int, interval_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-lookup-", ignore_cleanup_errors=True) as workdir:
        d = start_local_daemon(workdir, "--log-level", "WARNING", cpu_bytes="256MiB", nvme_bytes="0")
        report = {"machine": machine_facts(), "lookups": lookups, "clients": clients, "chain_blocks": 128,
                  "interval_us": round(interval_s * 1e6)}
        try:
            local, remote = Client(d.address), Client(d.address, transport="grpc")
            socket_only = Client(d.address, lookup_index=False)
            ns = local.register_namespace(Namespace(LOOKUP))
            remote.register_namespace(Namespace(LOOKUP))
            socket_only.register_namespace(Namespace(LOOKUP))
            hashes = ChainHasher(seed=1).chain(np.arange(128 * 16), 16)
            local.put(ns, hashes, [np.zeros(4096, np.uint8)] * 128)
            local.lookup(ns, hashes)
            socket_only.lookup(ns, hashes)
            time.sleep(0.5)   # the index fills in the background
            paths = {"mapped index": local, "unix socket": socket_only, FLOOR: InProcessDict(hashes)}
            report["idle"] = measured(paths, remote, ns, hashes, lookups, interval_s)
            spin_s = report["idle"]["mapped index"]["p50_us"] / 1e6
            report["spin_us"] = round(spin_s * 1e6, 1)
            paths[SPIN] = Spin(spin_s, len(hashes))
            load = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, d.address, str(clients), "120"],
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert load.stdout.readline().strip() == "ready"
                time.sleep(3)   # every load client connected and copying
                report["loaded"] = measured(paths, remote, ns, hashes, lookups, interval_s)
            finally:
                load.terminate()
                load.wait(30)
            for c in (local, socket_only, remote):
                c.close()
        finally:
            d.stop()
    return report


def markdown(r: dict) -> str:
    m = r["machine"]
    out = ["# Scheduler-path lookups (benchmarks/bench_lookup.py)", "",
           machine_line(m) + ". A 128-block chain, every block present, looked up by a "
           f"same-host client {r['lookups']} times (gRPC: a quarter as many); *under load*: {r['clients']} client "
           "threads in another process getting 1 MiB blocks over shared memory meanwhile.", "",
           "| daemon | path | p50 us | p99 us | mean us | p50 / floor's | p99 / floor's |",
           "|---|---|---|---|---|---|---|"]
    for state in ("idle", "loaded"):
        for path, v in r[state].items():
            paced = path.partition(", ")[2]
            floor = r[state][f"{FLOOR}, {paced}" if paced else FLOOR] if path != "grpc" else r[state][FLOOR]
            out.append(f"| {state} | {path} | {v['p50_us']} | {v['p99_us']} | {v['mean_us']} | "
                       f"{v['p50_us'] / floor['p50_us']:.1f} | {v['p99_us'] / floor['p99_us']:.1f} |")
    out += ["", "Rows without a rate: lookups back to back. Rows \"1 per N us\": one lookup started every N us "
                "(a scheduler asks once per arriving request). Back to back, each index-answered lookup's note to "
                "the daemon (it pins the hits and counts the lookup) arrives faster than the daemon's socket thread "
                "handles one, so the daemon runs flat out on the lookups themselves. The floor: the same chain walked in a dict "
                "inside the timing process (an engine's own prefix cache; nothing shared), timed the same way, so "
                "its p99 under load is what this host's scheduler alone adds to a 10 us lookup. The spin: a busy wait as long "
                f"as the mapped index's idle p50 ({r['spin_us']} us), timed the same way under load: the tail this "
                "host's scheduler gives any piece of work that long (a lookup preempted by the daemon or the load "
                "ends as late)."]
    for name in ("mapped index", next(k for k in r["loaded"] if k.startswith("mapped index, "))):
        lo = r["loaded"][name]
        out += ["", f"Goal (issue 14), {name}: p50 <= 100 us and p99 <= 500 us under load: p50 {lo['p50_us']} us "
                    f"({'met' if lo['p50_us'] <= 100 else 'missed'}), p99 {lo['p99_us']} us "
                    f"({'met' if lo['p99_us'] <= 500 else 'missed'})."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--interval-us", type=float, default=1000, help="spacing of the paced rows")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "lookup"))
    a = ap.parse_args()
    report = run(a.lookups, a.clients, a.interval_us / 1e6)
    write_report(a.out, report, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Scenario 6, load: many concurrent clients (worker processes of threads, and one asyncio process)
against one client, with latency percentiles, wrong bytes and the daemon's memory over time.

Load workers are child processes running ``benchmarks/reliability.py _load-worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from kvstore import Namespace
from kvstore.client import AsyncClient, Client
from kvstore.errors import KVStoreError
from kvstore.ops.local_daemon import LocalDaemon, start_local_daemon

from .common import KiB, MiB, daemon_log_errors, hashes, is_exact, layout, payload, rss

#: the suite's entry script; its ``_load-worker`` command runs ``run_load_worker`` in a child process
ENTRY_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability.py")

# -- 6. load ---------------------------------------------------------------------------------------

LOAD_OPS = ("lookup", "get", "put")


def _load_loop(c, ns: bytes, bb: int, seconds: float, seed: int, shared: list[bytes]) -> dict:
    rng = random.Random(seed)
    lat = {op: [] for op in LOAD_OPS}
    errors: dict[str, int] = {}
    wrong = 0
    mine = hashes(4096, seed=seed)
    n_put = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        op = rng.choice(LOAD_OPS)
        t0 = time.perf_counter()
        try:
            if op == "lookup":
                c.lookup(ns, shared[:32], lease=False)
            elif op == "get":
                batch = rng.sample(shared, 4)
                for h, g in zip(batch, c.get(ns, batch)):
                    wrong += g is not None and not is_exact(h, g, bb)
            else:
                batch = mine[n_put % 4096:n_put % 4096 + 2]
                n_put += 2
                c.put(ns, batch, [payload(h, bb) for h in batch])
        except (KVStoreError, OSError) as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            continue
        lat[op].append(time.perf_counter() - t0)
    return {"lat": lat, "errors": errors, "wrong": wrong}


def run_load_worker(args) -> None:
    """One load-generating process: ``threads`` sync Clients or ``tasks`` AsyncClients."""
    lay = layout(args.block_bytes, "reliability/load")
    shared = hashes(64, seed=5)
    results = []
    if args.mode == "async":
        async def one(i: int):
            async with AsyncClient(args.url, max_in_flight=1, timeout_s=30) as ac:
                ns = await ac.register_namespace(Namespace(lay))
                rng = random.Random(args.seed + i)
                lat = {op: [] for op in LOAD_OPS}
                errors: dict[str, int] = {}
                wrong = 0
                mine = hashes(4096, seed=args.seed + i)
                n_put = 0
                end = time.monotonic() + args.seconds
                while time.monotonic() < end:
                    op = rng.choice(LOAD_OPS)
                    t0 = time.perf_counter()
                    try:
                        if op == "lookup":
                            await ac.lookup(ns, shared[:32], lease=False)
                        elif op == "get":
                            batch = rng.sample(shared, 4)
                            for h, g in zip(batch, await ac.get(ns, batch)):
                                wrong += g is not None and not is_exact(h, g, args.block_bytes)
                        else:
                            batch = mine[n_put % 4096:n_put % 4096 + 2]
                            n_put += 2
                            await ac.put(ns, batch, [payload(h, args.block_bytes) for h in batch])
                    except (KVStoreError, OSError) as e:
                        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                        continue
                    lat[op].append(time.perf_counter() - t0)
                return {"lat": lat, "errors": errors, "wrong": wrong}

        async def all_tasks():
            return await asyncio.gather(*(one(i) for i in range(args.clients)))

        results = asyncio.run(all_tasks())
    else:
        out = [None] * args.clients

        def run(i: int) -> None:
            with Client(args.url, timeout_s=30, transport=args.transport) as c:
                ns = c.register_namespace(Namespace(lay))
                out[i] = _load_loop(c, ns, args.block_bytes, args.seconds, args.seed + i, shared)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        results = out
    with open(args.result_file, "w") as f:   # not stdout: the parent only reads it at the end
        json.dump(results, f)


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.sort(np.asarray(xs)) * 1e3
    return {"n": len(a), "p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "max_ms": round(float(a[-1]), 3)}


def _run_load(d: LocalDaemon, plan: list[tuple[str, str, int]], seconds: float, block_bytes: int) -> dict:
    """``plan``: (mode sync|async, transport, clients) per process. Samples the daemon's RSS."""
    procs, files = [], []
    for i, (mode, transport, n) in enumerate(plan):
        fd, result_file = tempfile.mkstemp(prefix="kvstore-load-", suffix=".json")
        os.close(fd)
        files.append(result_file)
        cmd = [sys.executable, ENTRY_SCRIPT, "_load-worker", "--url", d.address, "--mode", mode,
               "--transport", transport, "--clients", str(n), "--seconds", str(seconds), "--seed", str(1000 * (i + 1)),
               "--block-bytes", str(block_bytes), "--result-file", result_file]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    samples = []
    t0 = time.monotonic()
    while any(p.poll() is None for p in procs):
        with contextlib.suppress(OSError):
            samples.append((round(time.monotonic() - t0, 1), rss(d.pid)))
        time.sleep(0.5)
    results = []
    for p, result_file in zip(procs, files):
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"load worker failed: {err[-2000:]}")
        with open(result_file) as f:
            results += json.load(f)
        os.unlink(result_file)
    lat = {op: [x for r in results for x in r["lat"][op]] for op in LOAD_OPS}
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    total_ops = sum(len(v) for v in lat.values())
    return {"clients": sum(n for _, _, n in plan), "seconds": seconds, "ops": total_ops,
            "ops_per_s": round(total_ops / seconds, 1), "errors": errors, "error_count": sum(errors.values()),
            "wrong_bytes": sum(r["wrong"] for r in results),
            "latency": {op: _percentiles(lat[op]) for op in LOAD_OPS}, "rss_samples": samples}


def load(workdir: str, clients: int = 64, seconds: float = 20.0, block_bytes: int = 64 * KiB,
         procs: int = 4) -> dict:
    """64 concurrent clients (processes with threads + one asyncio process) vs one client."""
    d = start_local_daemon(os.path.join(workdir, "load"), "--cpu-slot-bytes", str(block_bytes), cpu_bytes="128MiB",
                     nvme_bytes="2GiB")
    try:
        with d.client() as c:
            lay = layout(block_bytes, "reliability/load")
            ns = c.register_namespace(Namespace(lay))
            shared = hashes(64, seed=5)
            c.put(ns, shared, [payload(h, block_bytes) for h in shared])
        single = _run_load(d, [("sync", "auto", 1)], seconds, block_bytes)
        n_async = clients // 2
        per_proc = max(1, (clients - n_async) // procs)
        transports = ["auto", "grpc", "bulk", "auto"]
        plan = [("sync", transports[i % 4], per_proc) for i in range(procs)] + [("async", "auto", n_async)]
        many = _run_load(d, plan, seconds, block_bytes)
        anon = [s["RssAnon"] for _, s in many["rss_samples"] if "RssAnon" in s]
        rss_summary = {"rss_anon_start_mib": round(anon[0] / MiB, 1) if anon else None,
                       "rss_anon_peak_mib": round(max(anon) / MiB, 1) if anon else None,
                       "rss_anon_end_mib": round(anon[-1] / MiB, 1) if anon else None,
                       "rss_anon_second_half_growth_mib": round((anon[-1] - anon[len(anon) // 2]) / MiB, 1) if anon else None,
                       "rss_total_end_mib": round(many["rss_samples"][-1][1]["VmRSS"] / MiB, 1) if anon else None}
        with d.client() as c:
            s = c.stats()
        alive = d.alive()
    finally:
        errors = daemon_log_errors(d)
        d.stop()
    for r in (single, many):
        r.pop("rss_samples")
    return {"single_client": single, "concurrent": many, "plan": plan, "block_bytes": block_bytes,
            "throughput_ratio": round(many["ops_per_s"] / max(single["ops_per_s"], 1e-9), 2), "rss": rss_summary,
            "daemon_alive": alive, "leases_left": s["leases"], "daemon_log_errors": errors,
            "demotions": s["counters"].get("demotions", 0), "evictions": s["counters"].get("evictions", 0)}

"""Store core throughput, side by side with the physical ceilings measured in the same run.

    .venv/bin/python benchmarks/bench_store.py [--quick] [--dir DIR] [--out PREFIX]

Per block size (1, 4, 16 MiB): put / get GB/s through the Store into each tier (CPU arena, NVMe
directory, GPU tier on the cpu device), next to memcpy and raw O_DIRECT write+fsync / read of the
same sizes; then lookup throughput (blocks/s) and chained hashing (tokens/s). Every figure is the
median of several repetitions (the machine is shared and noisy); the goals are ratios:
CPU tier >= 0.7x memcpy, NVMe >= 0.8x raw O_DIRECT, hashing >= 0.5 G tokens/s.
Writes ``PREFIX.json`` and ``PREFIX.md`` (default benchmarks/results/store, or store-quick).

``--small-only``: 64 KiB blocks, 64 per call, through a Store over a CPU tier, in this thread's CPU
time per block against memcpy (the goal: >= 0.8x) and against the same copies in a CPU tier's own
/dev/shm arena; then puts into a full CPU tier, each block evicting one (lru and prefix), against
memcpy and against the same puts into an empty tier; then the index's bytes per block put into a
running CPU tier (``tracemalloc``, lru and prefix). Writes results/store-small.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc

import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops import ceilings
from kvstore.ops.machine import machine_facts
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier
from kvstore.ops.report import machine_line, write_report

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOALS = {"cpu": 0.7, "nvme": 0.8, "hash_gtok_s": 0.5}


def layout(block_bytes: int) -> KVLayout:
    return KVLayout(model="bench/model", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                    block_tokens=16, block_bytes=block_bytes)


def payload_pool(size: int, n: int) -> list[np.ndarray]:
    """Distinct, already-touched source buffers (what an engine's KV pages would be)."""
    rng = np.random.default_rng(size)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def thread_cpu(fn):
    """``fn()`` and the CPU seconds this thread spent in it."""
    c0 = time.thread_time()
    out = fn()
    return out, time.thread_time() - c0


def elapsed(fn) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _no_ceiling() -> float:
    return 0.0


def bench_tier(make_tier, size: int, n: int, reps: int, batch: int = 1, put_ceiling=None,
               get_ceiling=None, get_batch: int = 1, front=None, more_ceilings=None) -> dict[str, float]:
    """Put ``n`` blocks through a Store over one tier (``batch`` blocks per put call), read them
    back with get_into (``get_batch`` blocks per call), delete them; ``reps`` rounds after a
    warm-up round. The ceilings (callables timing one pass over the same bytes) run in the same
    round, right before the tier, so each round gives a ratio measured under the same load; the
    result is the median of those ratios. ``front``: a tier placed above (a small CPU tier, so
    that puts land there and reach the measured tier as write-back demotions). ``more_ceilings``:
    name -> callable, each timed in every round too (CPU time only, ``cpu_us_per_block[name]``)."""
    tier = make_tier()
    store = Store(([front()] if front else []) + [tier], StoreConfig(promote_on_hit=False, eviction_policy="lru"))
    ns = store.register_namespace(Namespace(layout(size)))
    sources = payload_pool(size, min(n, 8))
    # pooled, page-aligned, touched output buffers (like the CPU arena's slots): O_DIRECT lands there
    outs = [np.frombuffer(ceilings.touched_buffer(size, fill=0), dtype=np.uint8)[:size]
            for _ in range(min(n, max(8, get_batch)))]
    hasher = ChainHasher()
    t = {"put": [], "get": [], "put_ceiling": [], "get_ceiling": []}
    cpu = {"put": [], "get": [], "put_ceiling": [], "get_ceiling": []}   # this thread's CPU seconds, same passes
    more_ceilings = more_ceilings or {}
    cpu.update({name: [] for name in more_ceilings})
    try:
        for r in range(reps + 1):
            hashes = hasher.chain(np.arange(16 * n) + r * 16 * n, 16)

            def put_all() -> None:
                for i in range(0, n, batch):
                    store.put(ns, hashes[i:i + batch],
                              [sources[j % len(sources)] for j in range(i, min(n, i + batch))],
                              parent=hashes[i - 1] if i else None)
                if front:
                    tier.sync()   # the demotions' one flush (group commit), counted in the put time

            def get_all() -> None:
                for i in range(0, n, get_batch):
                    part = hashes[i:i + get_batch]
                    got = store.get_into(ns, part, [outs[(i + k) % len(outs)] for k in range(len(part))])
                    if None in got:
                        raise RuntimeError("benchmark block missing")

            for name, ceiling in more_ceilings.items():
                _, c = thread_cpu(ceiling)
                if r:
                    cpu[name].append(c)
            t_put_ceiling, c_put_ceiling = thread_cpu(put_ceiling or _no_ceiling)
            t_put, c_put = thread_cpu(lambda: elapsed(put_all))
            t_get_ceiling, c_get_ceiling = thread_cpu(get_ceiling or _no_ceiling)
            t_get, c_get = thread_cpu(lambda: elapsed(get_all))
            if not np.array_equal(outs[(n - 1) % len(outs)], sources[(n - 1) % len(sources)]):
                raise RuntimeError("benchmark read back wrong bytes")
            store.delete(ns, hashes)
            if r:
                for k, v in (("put", t_put), ("get", t_get), ("put_ceiling", t_put_ceiling),
                             ("get_ceiling", t_get_ceiling)):
                    t[k].append(v)
                for k, v in (("put", c_put), ("get", c_get), ("put_ceiling", c_put_ceiling),
                             ("get_ceiling", c_get_ceiling)):
                    cpu[k].append(v)
    finally:
        store.close()
    out = {"put_gbps": median_gbps(size * n, t["put"]), "get_gbps": median_gbps(size * n, t["get"]),
           "cpu_us_per_block": {k: statistics.median(v) / n * 1e6 for k, v in cpu.items() if v}}
    if put_ceiling:
        out["put_ceiling_gbps"] = put_ceiling.bytes / statistics.median(t["put_ceiling"]) / 1e9
        out["put_ratio"] = statistics.median(
            (size * n / tp) / (put_ceiling.bytes / tc) for tp, tc in zip(t["put"], t["put_ceiling"]))
    if get_ceiling:
        out["get_ceiling_gbps"] = get_ceiling.bytes / statistics.median(t["get_ceiling"]) / 1e9
        out["get_ratio"] = statistics.median(
            (size * n / tg) / (get_ceiling.bytes / tc) for tg, tc in zip(t["get"], t["get_ceiling"]))
    return out


SMALL = 64 * 1024
SMALL_BATCH = 64


class ArenaCopies:
    """The copies alone, in the CPU tier's own kind of memory: a ``CpuTier``'s arena (a /dev/shm
    file the daemon shares), no store. ``put``: each of 8 pooled sources into the next 64 KiB of
    it; ``get``: each 64 KiB of it into one of 64 pooled outputs (as the benchmark's gets do)."""

    def __init__(self, n: int) -> None:
        self.n, self._tier = n, CpuTier(n * SMALL, slot_bytes=SMALL)
        arena = self._tier.arena
        self.slots = [arena[i * SMALL:(i + 1) * SMALL] for i in range(n)]
        self.sources = payload_pool(SMALL, 8)
        self.outs = [np.frombuffer(ceilings.touched_buffer(SMALL, fill=0), dtype=np.uint8)[:SMALL]
                     for _ in range(SMALL_BATCH)]

    def put(self) -> None:
        for i, slot in enumerate(self.slots):
            np.copyto(slot, self.sources[i % 8])

    def get(self) -> None:
        for i, slot in enumerate(self.slots):
            np.copyto(self.outs[i % SMALL_BATCH], slot)

    def close(self) -> None:
        self.slots = []
        self._tier.close()


def bench_small_blocks(reps: int, n: int) -> dict[str, float]:
    """``n`` blocks of 64 KiB through a Store over a CPU tier, ``SMALL_BATCH`` per put and per get
    call, against memcpy of the same blocks in the same rounds; the time per block above the copy
    is the store's per-block bookkeeping (planning, pins, index, policy, counters)."""
    memcpy = ceilings.MemcpyPass(SMALL, count=n, working_set=n * SMALL)
    arena = ArenaCopies(n)
    r = bench_tier(lambda: CpuTier(n * SMALL, slot_bytes=SMALL), SMALL, n, reps, batch=SMALL_BATCH,
                   get_batch=SMALL_BATCH, put_ceiling=memcpy, get_ceiling=memcpy,
                   more_ceilings={"arena_put": arena.put, "arena_get": arena.get})
    arena.close()
    us = {k: SMALL / (r[k] * 1e9) * 1e6 for k in ("put_gbps", "get_gbps", "put_ceiling_gbps", "get_ceiling_gbps")}
    c = r["cpu_us_per_block"]
    return {**r, "blocks": n, "batch": SMALL_BATCH,
            "cpu_put_ratio": c["put_ceiling"] / c["put"], "cpu_get_ratio": c["get_ceiling"] / c["get"],
            "copy_us_per_block": us["put_ceiling_gbps"],
            "put_us_per_block": us["put_gbps"], "get_us_per_block": us["get_gbps"],
            "put_bookkeeping_us_per_block": us["put_gbps"] - us["put_ceiling_gbps"],
            "get_bookkeeping_us_per_block": us["get_gbps"] - us["get_ceiling_gbps"]}


def bench_full_tier_puts(reps: int, n: int, policy: str) -> dict:
    """Puts into a full CPU tier with nothing below it (a cache in its steady state: each new
    block evicts one): ``n`` blocks of 64 KiB, one chain per round, ``SMALL_BATCH`` per put call,
    into a tier of ``n`` slots the warm-up round filled; this thread's CPU time per block against
    memcpy of the same blocks in the same round, and against puts of the same blocks into the
    same tier empty (each round's blocks deleted again, in one call, also timed), also in the same round."""
    memcpy = ceilings.MemcpyPass(SMALL, count=n, working_set=n * SMALL)
    store = Store([CpuTier(n * SMALL, slot_bytes=SMALL)], StoreConfig(promote_on_hit=False, eviction_policy=policy))
    empty = Store([CpuTier(n * SMALL, slot_bytes=SMALL)], StoreConfig(promote_on_hit=False, eviction_policy=policy))
    ns = store.register_namespace(Namespace(layout(SMALL)))
    ns_empty = empty.register_namespace(Namespace(layout(SMALL)))
    sources = payload_pool(SMALL, 8)
    hasher = ChainHasher()
    cpu: dict[str, list[float]] = {"copy": [], "full": [], "empty": [], "delete": []}

    def put_all(into: Store, namespace: bytes, hashes: list[bytes]) -> None:
        for i in range(0, n, SMALL_BATCH):
            results = into.put(namespace, hashes[i:i + SMALL_BATCH],
                               [sources[j % len(sources)] for j in range(i, min(n, i + SMALL_BATCH))],
                               parent=hashes[i - 1] if i else None)
            if results.count("stored") != len(results):
                raise RuntimeError("benchmark put refused")

    try:
        for r in range(reps + 1):
            hashes = hasher.chain(np.arange(16 * n) + r * 16 * n, 16)
            _, c_copy = thread_cpu(memcpy)
            _, c_full = thread_cpu(lambda: put_all(store, ns, hashes))
            _, c_empty = thread_cpu(lambda: put_all(empty, ns_empty, hashes))
            _, c_delete = thread_cpu(lambda: empty.delete(ns_empty, hashes))
            if r:
                for k, v in (("copy", c_copy), ("full", c_full), ("empty", c_empty), ("delete", c_delete)):
                    cpu[k].append(v)
        evictions = store.stats()["counters"]["evictions"]
        if evictions != reps * n:
            raise RuntimeError(f"expected {reps * n} evictions, saw {evictions}")
        out = np.zeros(SMALL, dtype=np.uint8)
        if store.get_into(ns, hashes[-1:], [out]) != [SMALL] or not np.array_equal(out, sources[(n - 1) % 8]):
            raise RuntimeError("benchmark read back wrong bytes")
    finally:
        store.close()
        empty.close()
    us = {k: statistics.median(v) / n * 1e6 for k, v in cpu.items()}
    return {"policy": policy, "blocks": n, "batch": SMALL_BATCH, "evictions": evictions, "cpu_us_per_block": us,
            "ratio": us["copy"] / us["full"], "vs_empty": us["empty"] / us["full"]}


#: blocks put for the live index's bytes (``live_index_bytes``), and their size (the index does not
#: depend on it: small blocks keep the arena small)
LIVE_BLOCKS = 100_000
LIVE_BLOCK = 4096


def live_index_bytes(blocks: int, policy: str) -> dict:
    """Bytes the store holds per block put into a running CPU tier (no restart): ``tracemalloc``
    over puts of ``blocks`` blocks in chains of 64 per call, every byte allocated and still held,
    over the blocks; and the five largest allocation sites. The caller's hashes are not counted."""
    store = Store([CpuTier(blocks * LIVE_BLOCK, slot_bytes=LIVE_BLOCK, pretouch=False)],
                  StoreConfig(eviction_policy=policy))
    try:
        ns = store.register_namespace(Namespace(layout(LIVE_BLOCK)))
        src = np.zeros(LIVE_BLOCK, dtype=np.uint8)
        hashes = ChainHasher().chain(np.arange(16 * blocks), 16)
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for i in range(0, blocks, SMALL_BATCH):
                part = hashes[i:i + SMALL_BATCH]
                store.put(ns, part, [src] * len(part), parent=hashes[i - 1] if i else None)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        total = sum(d.size_diff for d in after.compare_to(before, "filename"))
        sites = [(f"{os.path.relpath(d.traceback[0].filename, ROOT)}:{d.traceback[0].lineno}", d.size_diff / blocks)
                 for d in after.compare_to(before, "lineno")[:5]]
    finally:
        store.close()
    return {"blocks": blocks, "policy": policy, "bytes_per_block": total / blocks, "sites": sites}


def small_markdown(r: dict) -> str:
    m, x = r["machine"], r["small"]
    c = x["cpu_us_per_block"]
    return "\n".join([
        "# Store core: per-block bookkeeping of 64 KiB blocks",
        "",
        f"`python benchmarks/bench_store.py --small-only` — {x['blocks']} blocks of 64 KiB through a Store over a "
        f"CPU tier, {x['batch']} per put and per get call, medians of {r['reps']} rounds; each round times "
        "memcpy of the same blocks into an arena as large (numpy copyto, one core) right before the store.",
        "",
        machine_line(m, load=(r.get("load"), r.get("load_end"))) + f" (shared with other work: ratios, not absolute figures, are "
        f"what the run can judge); {m['time_utc']}.",
        "",
        "| | GB/s | vs memcpy | us per block | of which above the copy |",
        "|---|---|---|---|---|",
        f"| memcpy | {x['put_ceiling_gbps']:.2f} | 1.00x | {x['copy_us_per_block']:.1f} | - |",
        f"| put (64/call) | {x['put_gbps']:.2f} | {x['put_ratio']:.2f}x | {x['put_us_per_block']:.1f} "
        f"| {x['put_bookkeeping_us_per_block']:.1f} |",
        f"| get (64/call) | {x['get_gbps']:.2f} | {x['get_ratio']:.2f}x | {x['get_us_per_block']:.1f} "
        f"| {x['get_bookkeeping_us_per_block']:.1f} |",
        "",
        "The same passes in this thread's CPU time (``time.thread_time``: what the calls cost, without the "
        "time the shared host's scheduler held the thread back), medians per block:",
        "",
        "| | CPU us per block | vs memcpy | of which above the copy |",
        "|---|---|---|---|",
        f"| memcpy | {c['put_ceiling']:.1f} | 1.00x | - |",
        f"| put (64/call) | {c['put']:.1f} | {x['cpu_put_ratio']:.2f}x | {c['put'] - c['put_ceiling']:.1f} |",
        f"| get (64/call) | {c['get']:.1f} | {x['cpu_get_ratio']:.2f}x | {c['get'] - c['get_ceiling']:.1f} |",
        "",
    ] + ([
        "The copies alone in the CPU tier's own memory (a second CPU tier's /dev/shm arena, no store: 8 pooled "
        "sources into its slots, its slots into 64 pooled outputs), CPU time in the same rounds:",
        "",
        "| | CPU us per block | put / get vs this copy | of which above it |",
        "|---|---|---|---|",
        f"| sources into the arena | {c['arena_put']:.1f} | put {c['arena_put'] / c['put']:.2f}x "
        f"| {c['put'] - c['arena_put']:.1f} |",
        f"| the arena into outputs | {c['arena_get']:.1f} | get {c['arena_get'] / c['get']:.2f}x "
        f"| {c['get'] - c['arena_get']:.1f} |",
        "",
    ] if "arena_put" in c else []) + ([
        "Puts into a full CPU tier with nothing below it (a cache's steady state: each new block evicts the "
        f"one its policy names), {r['full_tier'][0]['blocks']} blocks of 64 KiB a round, one chain, "
        f"{SMALL_BATCH} per call; CPU time in the same rounds as memcpy of the same blocks and as the same puts "
        "into the same tier empty, and the delete of those blocks from it, all in one call:",
        "",
        "| policy | CPU us per block | vs memcpy | vs the same puts into an empty tier | evictions "
        "| delete, CPU us per block |",
        "|---|---|---|---|---|---|",
    ] + [f"| {f['policy']} | {f['cpu_us_per_block']['full']:.1f} | {f['ratio']:.2f}x | {f['vs_empty']:.2f}x "
         f"({f['cpu_us_per_block']['empty']:.1f} us) | {f['evictions']:,} "
         f"| {f['cpu_us_per_block'].get('delete', float('nan')):.1f} |" for f in r["full_tier"]] + [""]
        if "full_tier" in r else []) + [
        f"Index bytes per block put into a running CPU tier (``tracemalloc`` over {x['blocks']:,} puts of "
        f"{LIVE_BLOCK // 1024} KiB blocks, {SMALL_BATCH} per call, no restart), eviction policy {x['policy']}: "
        f"{x['bytes_per_block']:.0f} bytes; largest sites: "
        + ", ".join(f"{site} {b:.0f}" for site, b in x["sites"]) + "."
        for x in r.get("live_index", [])] + [""])


def bench_lookup(reps: int, blocks: int = 20_000, chain_len: int = 32) -> float:
    """lookup() of 32-block chains against a store holding ``blocks`` small blocks: blocks/s."""
    size = 4096
    store = Store([CpuTier(blocks * size, slot_bytes=size, pretouch=False)], StoreConfig(lease_seconds=1.0))
    ns = store.register_namespace(Namespace(layout(size)))
    src = np.zeros(size, dtype=np.uint8)
    hashes = ChainHasher().chain(np.arange(16 * blocks), 16)
    for i in range(0, blocks, chain_len):
        part = hashes[i:i + chain_len]
        store.put(ns, part, [src] * len(part), parent=hashes[i - 1] if i else None)
    chains = [hashes[i:i + chain_len] for i in range(0, blocks, chain_len)]
    times = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            for c in chains:
                if store.lookup(ns, c).num_hit != len(c):
                    raise RuntimeError("lookup missed")
            times.append(time.perf_counter() - t)
    finally:
        store.close()
    return blocks / statistics.median(times)


def bench_hashing(reps: int, tokens: int = 1 << 20) -> dict[str, float]:
    ids = np.random.default_rng(1).integers(0, 151_936, tokens, dtype=np.int32)
    out = {}
    for algo in ("xxh3_128", "sha256"):
        for bt in (16, 256):
            h = ChainHasher(algo)
            h.chain(ids[:4096], bt)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                h.chain(ids, bt)
                times.append(time.perf_counter() - t)
            out[f"{algo}_bt{bt}_gtok_s"] = tokens / statistics.median(times) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and bytes (a smoke run)")
    ap.add_argument("--dir", default="/var/tmp", help="where the NVMe tier and raw O_DIRECT files go")
    ap.add_argument("--out", default=None, help="output prefix (default benchmarks/results/store[-quick])")
    ap.add_argument("--sizes", default="1,4,16", help="block sizes in MiB")
    ap.add_argument("--small-only", action="store_true",
                    help="only the 64 KiB per-block bookkeeping figures (PREFIX default: results/store-small)")
    args = ap.parse_args()
    if args.small_only:
        here = os.path.dirname(os.path.abspath(__file__))
        reps = 3 if args.quick else 7
        results = {"machine": machine_facts(args.dir), "reps": reps, "load": os.getloadavg(),
                   "small": bench_small_blocks(reps, 1024 if args.quick else 4096), "load_end": os.getloadavg()}
        results["full_tier"] = [bench_full_tier_puts(reps, 1024 if args.quick else 4096, policy)
                                for policy in ("lru", "prefix")]
        results["live_index"] = [live_index_bytes(LIVE_BLOCKS // (5 if args.quick else 1), policy)
                                 for policy in ("lru", "prefix")]
        write_report(args.out or os.path.join(here, "results", "store-small"), results, small_markdown)
        return

    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results", "store-quick" if args.quick else "store")
    reps = 3 if args.quick else 5
    total = (64 if args.quick else 256) * MIB
    work = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    results: dict = {"machine": machine_facts(work), "reps": reps, "bytes_per_rep": total,
                     "sizes": {}}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            size = mib * MIB
            n = max(4, total // size)
            n_disk = max(4, min(n, (128 if not args.quick else 32) * MIB // size))
            row: dict[str, float] = {}
            print(f"{mib} MiB blocks ...", flush=True)
            row["memcpy_hot_gbps"] = ceilings.memcpy_gbps(size, reps=reps)
            memcpy = ceilings.MemcpyPass(size, count=n, working_set=n * size)

            def cpu_tier() -> CpuTier:
                return CpuTier(n * size, slot_bytes=min(size, 4 * MIB))

            cpu = bench_tier(cpu_tier, size, n, reps, put_ceiling=memcpy, get_ceiling=memcpy)
            cpu_batch = bench_tier(cpu_tier, size, n, reps, batch=16, put_ceiling=memcpy)
            gpu = bench_tier(lambda: GpuTier(n * size, slot_bytes=min(size, 4 * MIB), device="cpu"), size, n,
                             reps, put_ceiling=memcpy, get_ceiling=memcpy)
            del memcpy
            nvme_dir = os.path.join(work, "nvme")

            def nvme_tier() -> NvmeTier:
                shutil.rmtree(nvme_dir, ignore_errors=True)
                return NvmeTier(nvme_dir, n_disk * (size + HEADER_BYTES) + MIB)

            n_wb = max(n_disk, 32)

            def nvme_tier_wb() -> NvmeTier:
                shutil.rmtree(nvme_dir, ignore_errors=True)
                return NvmeTier(nvme_dir, n_wb * (size + HEADER_BYTES) + MIB)

            def one_block_cpu() -> CpuTier:
                return CpuTier(size, slot_bytes=min(size, 4 * MIB))

            with ceilings.ODirectWritePass(work, size, n_disk) as w, ceilings.ODirectReadPass(work, size, n_disk) as rd:
                nvme = bench_tier(nvme_tier, size, n_disk, reps, put_ceiling=w, get_ceiling=rd)
                nvme_batch = bench_tier(nvme_tier, size, n_disk, reps, batch=n_disk, put_ceiling=w,
                                        get_ceiling=rd, get_batch=n_disk)
            with ceilings.ODirectWritePass(work, size, n_wb, fsync=False) as w_nofsync:
                nvme_wb = bench_tier(nvme_tier_wb, size, n_wb, reps, put_ceiling=w_nofsync, front=one_block_cpu)
            shutil.rmtree(nvme_dir, ignore_errors=True)
            row.update({
                "memcpy_gbps": cpu["put_ceiling_gbps"],
                "cpu_put_gbps": cpu["put_gbps"], "cpu_get_gbps": cpu["get_gbps"],
                "cpu_put_vs_memcpy": cpu["put_ratio"], "cpu_get_vs_memcpy": cpu["get_ratio"],
                "cpu_put_batch_gbps": cpu_batch["put_gbps"], "cpu_put_batch_vs_memcpy": cpu_batch["put_ratio"],
                "gpu_on_cpu_put_gbps": gpu["put_gbps"], "gpu_on_cpu_get_gbps": gpu["get_gbps"],
                "gpu_on_cpu_put_vs_memcpy": gpu["put_ratio"], "gpu_on_cpu_get_vs_memcpy": gpu["get_ratio"],
                "odirect_write_gbps": nvme["put_ceiling_gbps"], "odirect_read_gbps": nvme["get_ceiling_gbps"],
                "nvme_put_gbps": nvme["put_gbps"], "nvme_get_gbps": nvme["get_gbps"],
                "nvme_put_vs_odirect_write": nvme["put_ratio"], "nvme_get_vs_odirect_read": nvme["get_ratio"],
                "nvme_put_batch_gbps": nvme_batch["put_gbps"],
                "nvme_put_batch_vs_odirect_write": nvme_batch["put_ratio"],
                "nvme_get_batch_gbps": nvme_batch["get_gbps"],
                "nvme_get_batch_vs_odirect_read": nvme_batch["get_ratio"],
                "odirect_write_nofsync_gbps": nvme_wb["put_ceiling_gbps"],
                "nvme_writeback_gbps": nvme_wb["put_gbps"],
                "nvme_writeback_vs_odirect_write_nofsync": nvme_wb["put_ratio"],
            })
            results["sizes"][f"{mib}MiB"] = row
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        print("lookup, hashing ...", flush=True)
        results["lookup_blocks_per_s"] = bench_lookup(reps)
        results["hashing"] = bench_hashing(reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["goals"] = goals(results)
    write_report(out, results, markdown)


def goals(r: dict) -> dict[str, bool]:
    rows = r["sizes"].values()
    return {
        "cpu_tier_ge_0.7x_memcpy": all(min(x["cpu_put_vs_memcpy"], x["cpu_get_vs_memcpy"]) >= GOALS["cpu"]
                                       for x in rows),
        "nvme_ge_0.8x_raw_o_direct": all(min(x["nvme_put_vs_odirect_write"], x["nvme_get_vs_odirect_read"])
                                         >= GOALS["nvme"] for x in rows),
        "nvme_writeback_and_batch_get_ge_0.8x_raw_o_direct": all(
            min(x["nvme_writeback_vs_odirect_write_nofsync"], x["nvme_get_batch_vs_odirect_read"]) >= GOALS["nvme"]
            for x in rows),
        "hashing_ge_0.5_gtok_s_at_16_tokens": r["hashing"]["xxh3_128_bt16_gtok_s"] >= GOALS["hash_gtok_s"],
        "hashing_ge_0.5_gtok_s_at_256_tokens": r["hashing"]["xxh3_128_bt256_gtok_s"] >= GOALS["hash_gtok_s"],
    }


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Store core benchmark",
        "",
        f"`python benchmarks/bench_store.py` — medians of {r['reps']} repetitions, "
        f"{r['bytes_per_rep'] // MIB} MiB per repetition (NVMe: at most 128 MiB), one Python thread, one "
        "block per put/get call unless stated. Outputs are pooled page-aligned buffers.",
        "",
        machine_line(m, "numpy", "torch", directory=True) + f"; {m['time_utc']}.",
        "",
        "GB/s = 1e9 bytes/s. Each round times a ceiling pass over the same bytes right before the tier "
        "pass; ratios are medians of the per-round ratios (so load changes between rounds cancel), GB/s "
        "are medians of the rounds. memcpy: numpy copyto "
        "of each block into the next slot of a destination as large as the tier's arena (the memory "
        "traffic the tier itself has); memcpy hot: the same two buffers over and over (cache-resident "
        "for small blocks, shown for reference only). NVMe: raw O_DIRECT write + fsync per file, and "
        "O_DIRECT read into an aligned buffer, same sizes, same directory. NVMe put = one block per "
        "put call (written into its slot of a slab file, then an fdatasync of the slab: group commit of a "
        "batch of one); batch = the whole chain in one call (one fdatasync per slab file for all).",
        "",
        "| block | memcpy hot | memcpy | CPU put | put/memcpy | CPU put (16/call) | batch/memcpy | CPU get "
        "| get/memcpy | GPU(cpu) put | GPU(cpu) get |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["sizes"].items():
        lines.append(
            f"| {name} | {x['memcpy_hot_gbps']:.2f} | {x['memcpy_gbps']:.2f} | {x['cpu_put_gbps']:.2f} "
            f"| {x['cpu_put_vs_memcpy']:.2f}x | {x['cpu_put_batch_gbps']:.2f} | {x['cpu_put_batch_vs_memcpy']:.2f}x "
            f"| {x['cpu_get_gbps']:.2f} | {x['cpu_get_vs_memcpy']:.2f}x "
            f"| {x['gpu_on_cpu_put_gbps']:.2f} | {x['gpu_on_cpu_get_gbps']:.2f} |")
    lines += [
        "",
        "| block | O_DIRECT write+fsync | NVMe put | put/raw | NVMe put (batch) | batch/raw | O_DIRECT read "
        "| NVMe get | get/raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["sizes"].items():
        lines.append(
            f"| {name} | {x['odirect_write_gbps']:.2f} | {x['nvme_put_gbps']:.2f} | {x['nvme_put_vs_odirect_write']:.2f}x "
            f"| {x['nvme_put_batch_gbps']:.2f} | {x['nvme_put_batch_vs_odirect_write']:.2f}x "
            f"| {x['odirect_read_gbps']:.2f} | {x['nvme_get_gbps']:.2f} | {x['nvme_get_vs_odirect_read']:.2f}x |")
    lines += [
        "",
        "Write-back and batched reads: *write-back* = puts into a one-block CPU tier, so every block "
        "reaches NVMe as a demotion (no fsync each; one flush of the slab at the end of the round, "
        "counted), against raw O_DIRECT writes without fsync (what LMCache's local disk backend does); "
        "the last block of each round stays in the CPU tier (at most 1/32 of the bytes). *get (batch)* "
        "= the whole chain in one get_into call, NVMe reads up to 4 in flight (each a run of neighbouring "
        "slots of up to 1 MiB), against the raw O_DIRECT "
        "reads above (one at a time).",
        "",
        "| block | O_DIRECT write, no fsync | NVMe write-back | write-back/raw | NVMe get (batch) | batch get/raw |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in r["sizes"].items():
        if "nvme_writeback_gbps" in x:
            lines.append(
                f"| {name} | {x['odirect_write_nofsync_gbps']:.2f} | {x['nvme_writeback_gbps']:.2f} "
                f"| {x['nvme_writeback_vs_odirect_write_nofsync']:.2f}x | {x['nvme_get_batch_gbps']:.2f} "
                f"| {x['nvme_get_batch_vs_odirect_read']:.2f}x |")
    h = r["hashing"]
    lines += [
        "",
        f"Lookup: {r['lookup_blocks_per_s'] / 1e6:.2f} M blocks/s (32-block chains, 20,000 blocks stored, "
        "leases on).",
        "",
        "| hashing (1 Mi tokens, int32 numpy input) | block_tokens 16 | block_tokens 256 |",
        "|---|---|---|",
        f"| xxh3_128 (default), G tokens/s | {h['xxh3_128_bt16_gtok_s']:.2f} | {h['xxh3_128_bt256_gtok_s']:.2f} |",
        f"| sha256, G tokens/s | {h['sha256_bt16_gtok_s']:.2f} | {h['sha256_bt256_gtok_s']:.2f} |",
        "",
        "Goals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in r["goals"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

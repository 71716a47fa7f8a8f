"""How the store's cost grows with the number of blocks, in one process (no daemon, no wire).

    .venv/bin/python benchmarks/bench_scale.py [--blocks N [N ...]] [--policies P [P ...]] [--dir DIR] [--out PREFIX]

For each N, and each eviction policy (``--policies``: LRU, and the default prefix-aware one): a Store
over a 64 MiB CPU tier of 16 KiB slots and an NVMe tier large enough for every block, both under
that policy: N blocks of 16 KiB are put in chains of 1,024 per call, so all but the last 4,096
reach NVMe as demotions. Against it, in the same run: raw O_DIRECT writes of the same N blocks of 16 KiB into
one preallocated file (no fsync each: what a write-back demotion needs). Then the store is closed
and opened again on the same directory (warm restart: the index rebuilt from the slabs' record files),
timed; and once more under ``tracemalloc`` for the bytes the index holds per recovered block
(every byte allocated while the store opens, over the blocks recovered), and where they are (by
allocation site). Then, per policy, puts once both tiers are full (``steady``: ``--steady-blocks``
more blocks into an NVMe tier sized for that many, each demoting one block and dropping one),
against raw O_DIRECT writes of as many blocks, and then gets of the newest blocks only on NVMe,
each hit promoted into the full CPU tier.
Writes ``PREFIX.json`` and ``PREFIX.md`` (default benchmarks/results/scale).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import time
import tracemalloc

import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, write_report
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier

BLOCK = 16 * 1024
CPU_BYTES = 64 << 20
CHAIN = 1024
#: allocation sites named in the breakdown of the index's bytes (largest first)
SITES = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout() -> KVLayout:
    return KVLayout(model="bench/scale", num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                    block_tokens=16, block_bytes=BLOCK)


def open_store(nvme_dir: str, blocks: int, policy: str) -> Store:
    return Store([CpuTier(CPU_BYTES, slot_bytes=BLOCK), NvmeTier(nvme_dir, blocks * (HEADER_BYTES + BLOCK) + (64 << 20))],
                 StoreConfig(eviction_policy=policy))


def raw_o_direct_writes(directory: str, blocks: int) -> float:
    """Seconds to write ``blocks`` blocks of 16 KiB with O_DIRECT pwrite into one file, in order."""
    path = os.path.join(directory, "raw-o-direct")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    buf = mmap.mmap(-1, BLOCK)   # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    try:
        os.posix_fallocate(fd, 0, blocks * BLOCK)
        t0 = time.perf_counter()
        for k in range(blocks):
            os.pwrite(fd, buf, k * BLOCK)
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def run(blocks: int, directory: str, policy: str, raw_s: float) -> dict:
    """One size under one policy, against ``raw_s`` seconds of raw O_DIRECT writes of as many blocks."""
    work = tempfile.mkdtemp(prefix="bench-scale-", dir=directory)
    nvme_dir = os.path.join(work, "nvme")
    try:
        store = open_store(nvme_dir, blocks, policy)
        ns = store.register_namespace(Namespace(layout()))
        sources = [np.random.default_rng(k).integers(0, 256, BLOCK, dtype=np.uint8) for k in range(8)]
        hasher = ChainHasher()
        t0, c0 = time.perf_counter(), time.process_time()
        for start in range(0, blocks, CHAIN):
            n = min(CHAIN, blocks - start)
            hashes = hasher.chain(np.arange(16 * n) + 16 * start, 16)
            store.put(ns, hashes, [sources[k % 8] for k in range(n)])
        store.tiers[-1].sync()   # the demotions' one flush, counted
        put_s, put_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        on_nvme = store.stats()["tiers"]["nvme"]["blocks"]
        store.close()

        t0, c0 = time.perf_counter(), time.process_time()
        again = open_store(nvme_dir, blocks, policy)
        restart_s, restart_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        recovered = again.stats()["blocks"]
        again.close()

        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        measured = open_store(nvme_dir, blocks, policy)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        sites = after.compare_to(before, "lineno")
        index_bytes = sum(s.size_diff for s in sites)
        recovered_here = max(measured.stats()["blocks"], 1)
        by_site = [(f"{os.path.relpath(s.traceback[0].filename, ROOT)}:{s.traceback[0].lineno}",
                    s.size_diff / recovered_here) for s in sites[:SITES]]
        measured.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "blocks": blocks, "policy": policy, "block_bytes": BLOCK, "chain": CHAIN, "cpu_bytes": CPU_BYTES,
        "put_s": put_s, "put_blocks_per_s": blocks / put_s, "put_gbps": blocks * BLOCK / put_s / 1e9,
        "blocks_on_nvme": on_nvme,
        "raw_o_direct_s": raw_s, "raw_o_direct_gbps": blocks * BLOCK / raw_s / 1e9,
        "demoting_put_vs_raw_o_direct": raw_s / put_s,
        "restart_s": restart_s, "recovered_blocks": recovered,
        "restart_s_per_100k_blocks": restart_s / max(recovered, 1) * 100_000,
        "put_cpu_s": put_cpu_s, "restart_cpu_s": restart_cpu_s,
        "restart_cpu_s_per_100k_blocks": restart_cpu_s / max(recovered, 1) * 100_000,
        "index_bytes_per_block": index_bytes / max(recovered, 1),
        "index_bytes_per_block_by_site": by_site,
    }


def steady(blocks: int, directory: str, policy: str, raw_s: float) -> dict:
    """Puts once both tiers are full (a long-running node's steady state): an NVMe tier sized for
    ``blocks`` blocks under the 64 MiB CPU tier, ``blocks`` put to fill both, then ``blocks`` more
    timed, each demoting one CPU block and dropping one NVMe block; against ``raw_s`` seconds of
    raw O_DIRECT writes of as many blocks."""
    work = tempfile.mkdtemp(prefix="bench-scale-steady-", dir=directory)
    try:
        store = Store([CpuTier(CPU_BYTES, slot_bytes=BLOCK), NvmeTier(os.path.join(work, "nvme"),
                                                                       blocks * (HEADER_BYTES + BLOCK))],
                      StoreConfig(eviction_policy=policy))
        ns = store.register_namespace(Namespace(layout()))
        sources = [np.random.default_rng(k).integers(0, 256, BLOCK, dtype=np.uint8) for k in range(8)]
        hasher = ChainHasher()

        def put(first: int, count: int) -> None:
            for start in range(first, first + count, CHAIN):
                n = min(CHAIN, first + count - start)
                hashes = hasher.chain(np.arange(16 * n) + 16 * start, 16)
                if store.put(ns, hashes, [sources[k % 8] for k in range(n)]).count("stored") != n:
                    raise RuntimeError("a steady-state put was refused")
            store.tiers[-1].sync()

        filled = blocks + CPU_BYTES // BLOCK   # both tiers' blocks
        put(0, filled)
        evicted_before = store.stats()["counters"].get("evictions", 0)
        t0, c0 = time.perf_counter(), time.process_time()
        put(filled, blocks)
        put_s, put_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        evictions = store.stats()["counters"].get("evictions", 0) - evicted_before
        # then the newest blocks only on NVMe read back, chain by chain: each hit promoted into the
        # CPU tier, whose victims (only there) are written down, and NVMe drops its oldest
        below_cpu = filled + blocks - CPU_BYTES // BLOCK   # the CPU tier holds the blocks put after this
        chains = [start for start in range(filled, filled + blocks, CHAIN) if start + CHAIN <= below_cpu]
        chains = chains[-max(1, min(blocks // 2, 16_384) // CHAIN):]   # the newest whole chains put
        reads = CHAIN * len(chains)
        outs = [np.empty(BLOCK, dtype=np.uint8) for _ in range(CHAIN)]
        promoted_before = store.stats()["counters"].get("promotions", 0)
        t0 = time.perf_counter()
        hits = 0
        for start in chains:
            hashes = hasher.chain(np.arange(16 * CHAIN) + 16 * start, 16)
            hits += sum(n is not None for n in store.get_into(ns, hashes, outs))
        get_s = time.perf_counter() - t0
        promotions = store.stats()["counters"].get("promotions", 0) - promoted_before
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"blocks": blocks, "policy": policy, "put_s": put_s, "put_cpu_s": put_cpu_s, "evictions": evictions,
            "put_blocks_per_s": blocks / put_s, "put_gbps": blocks * BLOCK / put_s / 1e9,
            "raw_o_direct_gbps": blocks * BLOCK / raw_s / 1e9, "vs_raw_o_direct": raw_s / put_s,
            "reads": reads, "read_hits": hits, "promotions": promotions, "promoting_get_s": get_s,
            "promoting_get_blocks_per_s": reads / get_s, "promoting_get_gbps": reads * BLOCK / get_s / 1e9}


def markdown(r: dict) -> str:
    m, runs = r["machine"], r["scale"]
    sizes = " ".join(dict.fromkeys(str(x["blocks"]) for x in runs))
    policies = " ".join(dict.fromkeys(x.get("policy", "lru") for x in runs))
    x0 = runs[0]
    cols = " | ".join(f"{x['blocks']:,} blocks, {x.get('policy', 'lru')}" for x in runs)
    row = lambda name, f: f"| {name} | " + " | ".join(f(x) for x in runs) + " |"   # noqa: E731
    return "\n".join([
        "# Store scale: demoting puts, warm restart, index bytes",
        "",
        f"`python benchmarks/bench_scale.py --blocks {sizes} --policies {policies}` — one process, each size "
        f"and eviction policy in turn (lru; prefix: the prefix-aware default), a Store over a "
        f"{x0['cpu_bytes'] >> 20} MiB CPU tier of 16 KiB slots and an NVMe tier, both under that policy; N blocks of "
        "16 KiB put in "
        f"chains of {x0['chain']} per call (all but the CPU tier's last blocks reach NVMe as demotions, "
        "one flush at the end counted); then the store is closed and opened again on the same directory (warm "
        "restart, timed: the tiers set up, the index rebuilt from the slabs' record files), and opened once more "
        "under tracemalloc for the bytes held per recovered block.",
        "",
        machine_line(m, directory=True, load=(r["load"], r.get("load_after", "?")))
        + f" (shared with other work); {m['time_utc']}.",
        "",
        f"| figure | {cols} |",
        "|---|" + "---|" * len(runs),
        row("demoting puts", lambda x: f"{x['put_blocks_per_s']:,.0f} blocks/s, {x['put_gbps']:.3f} GB/s"),
        row("raw O_DIRECT writes of the same blocks (one file, one fdatasync)", lambda x: f"{x['raw_o_direct_gbps']:.3f} GB/s"),
        row("demoting puts vs raw O_DIRECT", lambda x: f"{x['demoting_put_vs_raw_o_direct']:.2f}x"),
        row("warm restart", lambda x: f"{x['restart_s']:.2f} s for {x['recovered_blocks']:,} blocks recovered"),
        row("warm restart per 100k blocks recovered", lambda x: f"{x['restart_s_per_100k_blocks']:.2f} s"),
        row("CPU time of the process (all threads): puts; warm restart per 100k blocks recovered",
            lambda x: f"{x['put_cpu_s']:.1f} s of {x['put_s']:.1f} s; {x['restart_cpu_s_per_100k_blocks']:.2f} s"
            if "restart_cpu_s" in x else "-"),
        row("index memory per recovered block (tracemalloc)", lambda x: f"{x['index_bytes_per_block']:.0f} bytes"),
        "",
        *[f"Index bytes per recovered block by allocation site ({x['blocks']:,} blocks, {x.get('policy', 'lru')}): "
          + ", ".join(f"{site} {b:.0f}" for site, b in x["index_bytes_per_block_by_site"]) + "."
          for x in runs if "index_bytes_per_block_by_site" in x],
        "",
        *([f"Puts once both tiers are full (`--steady-blocks {r['steady'][0]['blocks']}`: an NVMe tier sized for "
           f"{r['steady'][0]['blocks']:,} blocks under the CPU tier, filled, then as many more blocks timed, each "
           "demoting one CPU block and dropping one NVMe block, one flush at the end counted), against raw O_DIRECT "
           "writes of as many blocks:",
           "",
           "| policy | steady-state puts | vs raw O_DIRECT | NVMe blocks dropped | CPU time of the process "
           "| then promoting gets of blocks only on NVMe |",
           "|---|---|---|---|---|---|"]
          + [f"| {x['policy']} | {x['put_blocks_per_s']:,.0f} blocks/s, {x['put_gbps']:.3f} GB/s "
             f"| {x['vs_raw_o_direct']:.2f}x | {x['evictions']:,} | {x['put_cpu_s']:.1f} s of {x['put_s']:.1f} s | "
             + (f"{x['promoting_get_blocks_per_s']:,.0f} blocks/s, {x['promoting_get_gbps']:.3f} GB/s "
                f"({x['read_hits']:,} of {x['reads']:,} hit, {x['promotions']:,} promoted) |"
                if "reads" in x else "- |")
             for x in r["steady"]]
          + ["", f"The promoting gets read {CHAIN} blocks a call, the newest blocks NVMe alone holds: each hit is "
                 "copied into the CPU tier, whose victims, held only there, are written to NVMe first.", ""]
          if r.get("steady") else []),
        *[f"Under {p}, warm restart grows by {_marginal(rs):.2f} s ({_marginal_cpu(rs):.2f} s of CPU) per 100k "
          f"more blocks recovered from {rs[0]['recovered_blocks']:,} to {rs[-1]['recovered_blocks']:,} (the rest "
          "is a fixed cost: the CPU tier's arena, the NVMe directory's checks)."
          for p in policies.split() if len(rs := [x for x in runs if x.get("policy", "lru") == p]) > 1],
        "",
    ])


def _marginal(runs: list[dict]) -> float:
    a, b = runs[0], runs[-1]
    return (b["restart_s"] - a["restart_s"]) / max(b["recovered_blocks"] - a["recovered_blocks"], 1) * 100_000


def _marginal_cpu(runs: list[dict]) -> float:
    a, b = runs[0], runs[-1]
    return (b["restart_cpu_s"] - a["restart_cpu_s"]) / max(b["recovered_blocks"] - a["recovered_blocks"], 1) * 100_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000])
    ap.add_argument("--policies", nargs="+", default=["lru", "prefix"], help="eviction policies, each run in turn")
    ap.add_argument("--dir", default="/var/tmp", help="where the NVMe tier and the raw file go")
    ap.add_argument("--out", default=None, help="output prefix (default benchmarks/results/scale)")
    ap.add_argument("--steady-blocks", type=int, default=100_000,
                    help="blocks the NVMe tier holds in the steady-state run, and blocks timed there (0: none)")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    load = lambda: " ".join(f"{v:.1f}" for v in os.getloadavg())   # noqa: E731
    results = {"machine": machine_facts(args.dir), "load": load(), "scale": []}
    for n in args.blocks:   # the report is written after each run: a long last one does not hold back the rest
        scratch = tempfile.mkdtemp(prefix="bench-scale-raw-", dir=args.dir)
        try:
            raw_s = raw_o_direct_writes(scratch, n)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for policy in args.policies:
            results["scale"].append(run(n, args.dir, policy, raw_s))
            results["load_after"] = load()
            write_report(args.out or os.path.join(here, "results", "scale"), results, markdown)
    if args.steady_blocks:
        scratch = tempfile.mkdtemp(prefix="bench-scale-raw-", dir=args.dir)
        try:
            raw_s = raw_o_direct_writes(scratch, args.steady_blocks)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results["steady"] = []
        for policy in args.policies:
            results["steady"].append(steady(args.steady_blocks, args.dir, policy, raw_s))
            results["load_after"] = load()
            write_report(args.out or os.path.join(here, "results", "scale"), results, markdown)


if __name__ == "__main__":
    main()

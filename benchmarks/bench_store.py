"""Store core throughput, side by side with the physical ceilings measured in the same run.

    python benchmarks/bench_store.py [--quick] [--dir DIR] [--out PREFIX]

Per block size (1, 4, 16 MiB): put / get GB/s through the Store into each tier (CPU arena, NVMe
directory, GPU tier on the cpu device), next to memcpy and raw O_DIRECT write+fsync / read of the
same sizes; then lookup throughput (blocks/s) and chained hashing (tokens/s). Every figure is the
median of several repetitions (the machine is shared and noisy); the goals are ratios:
CPU tier >= 0.7x memcpy, NVMe >= 0.8x raw O_DIRECT, hashing >= 0.5 G tokens/s.
Writes ``PREFIX.json`` and ``PREFIX.md`` (default benchmarks/results/store, or store-quick).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ceilings  # noqa: E402

from kvstore.keys import ChainHasher, KVLayout, Namespace  # noqa: E402
from kvstore.store import Store, StoreConfig  # noqa: E402
from kvstore.tiers.cpu import CpuTier  # noqa: E402
from kvstore.tiers.gpu import GpuTier  # noqa: E402
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier  # noqa: E402

MIB = 1 << 20
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


def bench_tier(make_tier, size: int, n: int, reps: int, batch: int = 1) -> dict[str, float]:
    """Put ``n`` blocks through a Store over one tier (``batch`` blocks per put call), read them
    back with get_into, delete them; repeated ``reps`` times (after one warm-up round)."""
    tier = make_tier()
    store = Store([tier], StoreConfig(promote_on_hit=False, eviction_policy="lru"))
    ns = store.register_namespace(Namespace(layout(size)))
    sources = payload_pool(size, min(n, 8))
    # pooled, page-aligned, touched output buffers (like the CPU arena's slots): O_DIRECT lands there
    outs = [np.frombuffer(ceilings.touched_buffer(size, fill=0), dtype=np.uint8)[:size] for _ in range(min(n, 8))]
    hasher = ChainHasher()
    put_s, get_s = [], []
    try:
        for r in range(reps + 1):
            hashes = hasher.chain(np.arange(16 * n) + r * 16 * n, 16)
            t = time.perf_counter()
            for i in range(0, n, batch):
                store.put(ns, hashes[i:i + batch], [sources[j % len(sources)] for j in range(i, min(n, i + batch))],
                          parent=hashes[i - 1] if i else None)
            t_put = time.perf_counter() - t
            t = time.perf_counter()
            for i, h in enumerate(hashes):
                if store.get_into(ns, [h], [outs[i % len(outs)]])[0] is None:
                    raise RuntimeError("benchmark block missing")
            t_get = time.perf_counter() - t
            if not np.array_equal(outs[(n - 1) % len(outs)], sources[(n - 1) % len(sources)]):
                raise RuntimeError("benchmark read back wrong bytes")
            store.delete(ns, hashes)
            if r:
                put_s.append(t_put)
                get_s.append(t_get)
    finally:
        store.close()
    return {"put_gbps": median_gbps(size * n, put_s), "get_gbps": median_gbps(size * n, get_s)}


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
    args = ap.parse_args()

    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results", "store-quick" if args.quick else "store")
    reps = 3 if args.quick else 5
    total = (64 if args.quick else 256) * MIB
    work = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    results: dict = {"machine": ceilings.machine_facts(work), "reps": reps, "bytes_per_rep": total,
                     "sizes": {}}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            size = mib * MIB
            n = max(4, total // size)
            n_disk = max(4, min(n, (128 if not args.quick else 32) * MIB // size))
            row: dict[str, float] = {}
            print(f"{mib} MiB blocks ...", flush=True)
            row["memcpy_hot_gbps"] = ceilings.memcpy_gbps(size, reps=reps)
            row["memcpy_gbps"] = ceilings.memcpy_gbps(size, reps=reps, working_set=n * size)
            row["odirect_write_gbps"] = ceilings.odirect_write_gbps(work, size, reps=reps, files=n_disk)
            row["odirect_read_gbps"] = ceilings.odirect_read_gbps(work, size, reps=reps, files=n_disk)
            cpu = bench_tier(lambda: CpuTier(n * size, slot_bytes=min(size, 4 * MIB)), size, n, reps)
            nvme_dir = os.path.join(work, "nvme")
            nvme = bench_tier(lambda: NvmeTier(nvme_dir, n_disk * (size + HEADER_BYTES) + MIB), size, n_disk,
                              reps)
            shutil.rmtree(nvme_dir, ignore_errors=True)
            nvme_batch = bench_tier(lambda: NvmeTier(nvme_dir, n_disk * (size + HEADER_BYTES) + MIB), size,
                                    n_disk, reps, batch=n_disk)
            shutil.rmtree(nvme_dir, ignore_errors=True)
            row["nvme_put_batch_gbps"] = nvme_batch["put_gbps"]
            gpu = bench_tier(lambda: GpuTier(n * size, slot_bytes=min(size, 4 * MIB), device="cpu"), size, n,
                             reps)
            for name, r in (("cpu", cpu), ("nvme", nvme), ("gpu_on_cpu", gpu)):
                for k, v in r.items():
                    row[f"{name}_{k}"] = v
            row["cpu_put_vs_memcpy"] = row["cpu_put_gbps"] / row["memcpy_gbps"]
            row["cpu_get_vs_memcpy"] = row["cpu_get_gbps"] / row["memcpy_gbps"]
            row["gpu_on_cpu_put_vs_memcpy"] = row["gpu_on_cpu_put_gbps"] / row["memcpy_gbps"]
            row["gpu_on_cpu_get_vs_memcpy"] = row["gpu_on_cpu_get_gbps"] / row["memcpy_gbps"]
            row["nvme_put_vs_odirect_write"] = row["nvme_put_gbps"] / row["odirect_write_gbps"]
            row["nvme_put_batch_vs_odirect_write"] = row["nvme_put_batch_gbps"] / row["odirect_write_gbps"]
            row["nvme_get_vs_odirect_read"] = row["nvme_get_gbps"] / row["odirect_read_gbps"]
            results["sizes"][f"{mib}MiB"] = row
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        print("lookup, hashing ...", flush=True)
        results["lookup_blocks_per_s"] = bench_lookup(reps)
        results["hashing"] = bench_hashing(reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["goals"] = goals(results)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(markdown(results))
    print(markdown(results))


def goals(r: dict) -> dict[str, bool]:
    rows = r["sizes"].values()
    return {
        "cpu_tier_ge_0.7x_memcpy": all(min(x["cpu_put_vs_memcpy"], x["cpu_get_vs_memcpy"]) >= GOALS["cpu"]
                                       for x in rows),
        "nvme_ge_0.8x_raw_o_direct": all(min(x["nvme_put_vs_odirect_write"], x["nvme_get_vs_odirect_read"])
                                         >= GOALS["nvme"] for x in rows),
        "hashing_ge_0.5_gtok_s_at_16_tokens": r["hashing"]["xxh3_128_bt16_gtok_s"] >= GOALS["hash_gtok_s"],
        "hashing_ge_0.5_gtok_s_at_256_tokens": r["hashing"]["xxh3_128_bt256_gtok_s"] >= GOALS["hash_gtok_s"],
    }


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Store core benchmark",
        "",
        f"`python benchmarks/bench_store.py` — medians of {r['reps']} repetitions, "
        f"{r['bytes_per_rep'] // MIB} MiB per repetition (NVMe: at most 128 MiB), one Python thread.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}, "
        f"NVMe dir on {m.get('dir_fs_type')} (O_DIRECT {'yes' if m.get('dir_o_direct') else 'no'}), "
        f"Python {m['python']}, numpy {m['numpy']}, torch {m.get('torch', '-')}, at {m['time_utc']}.",
        "",
        "GB/s = 1e9 bytes/s. Ratios are against ceilings measured in the same run. memcpy: numpy copyto "
        "of each block into the next slot of a destination as large as the tier's arena (the memory "
        "traffic the tier itself has); memcpy hot: the same two buffers over and over (cache-resident "
        "for small blocks, shown for reference only). NVMe: raw O_DIRECT write + fsync per file, and "
        "O_DIRECT read into an aligned buffer, same sizes, same directory. NVMe put = one block per "
        "put call (file fsync + rename + directory fsync each); batch = the whole chain in one call "
        "(one directory fsync).",
        "",
        "| block | memcpy hot | memcpy | CPU put | CPU get | put/memcpy | get/memcpy | GPU(cpu) put | GPU(cpu) get |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["sizes"].items():
        lines.append(
            f"| {name} | {x['memcpy_hot_gbps']:.2f} | {x['memcpy_gbps']:.2f} | {x['cpu_put_gbps']:.2f} "
            f"| {x['cpu_get_gbps']:.2f} | {x['cpu_put_vs_memcpy']:.2f}x | {x['cpu_get_vs_memcpy']:.2f}x "
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

#!/usr/bin/env python3
"""What the vLLM connector's ``blocks_per_chunk`` buys: the cost of fetching one 2048-token prefix
from a daemon as the connector does it (the scheduler's lookup of the chain, then the worker's
``get_into`` into a staging buffer, then placing every layer into vLLM's paged KV tensors), with
16-token vLLM blocks stored one per kvstore block, 4 or 16 per chunk. Writes benchmarks/results/vllm_chunking.{json,md}.

    .venv/bin/python benchmarks/bench_vllm_chunking.py [--reps 7] [--models smollm2-135m,llama3-8b,llama3.2-1b]

Paths: shared memory (same host), the raw-TCP side channel and gRPC streams (the remote paths,
over loopback here). Every N is judged against N = 1 and against a ceiling measured in the same
run, one ceiling pass right before each measured pass: a memcpy of the prefix's bytes with
neither side in the caches (shm) or raw TCP moving them over one loopback connection (remote).
The N's are interleaved within each repetition so drift on this shared machine hits them alike.
Why measure rather than assume: fewer, larger blocks cut per-block work (hashes, lookup entries,
lease and slot bookkeeping, one request per block on the wire), but a chunk only hits whole, so
what a prompt can reuse shrinks to whole chunks; the default must pay for that.
Each N gets a private daemon (kvstore.ops.local_daemon) whose CPU-tier slot is its block size
(``--slots block``, docs/config.md's advice: every block one contiguous run) or the default
(``--slots default``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
PREFIX, VLLM_BLOCK = 2048, 16
#: model -> (layers, KV heads, head dim), bf16, FlashAttention pages [2, 16, heads, dim] per layer;
#: smollm2-135m is the real model the engine tests and benchmarks run (scripts/real-model.sh)
MODELS = {"smollm2-135m": (30, 3, 64), "llama3-8b": (32, 8, 128), "llama3.2-1b": (16, 8, 64)}


def fetch_pass(client, ns_id: bytes, hashes: list[bytes], outs: list[np.ndarray]) -> tuple[float, float]:
    """(lookup seconds, get seconds) of one fetch of the whole prefix."""
    t0 = time.perf_counter()
    hit = client.lookup(ns_id, hashes).num_hit
    t1 = time.perf_counter()
    sizes = client.get_into(ns_id, hashes, outs)
    t2 = time.perf_counter()
    assert hit == len(hashes) and sizes == [outs[0].nbytes] * len(hashes), (hit, sizes[:3])
    return t1 - t0, t2 - t1


def start_daemons(workdir: str, block: int, prefix_bytes: int, chunks: list[int], slots: str) -> dict:
    """One private daemon per N, its CPU tier's slot the kvstore block size (``slots`` "block":
    docs/config.md's advice, each block one contiguous run) or the default 256 KiB."""
    from kvstore.ops.local_daemon import start_local_daemon

    out = {}
    for n in chunks:
        flags = ["--cpu-slot-bytes", str(n * block)] if slots == "block" else []
        out[n] = start_local_daemon(os.path.join(workdir, f"n{n}"), *flags, "--log-level", "WARNING", nvme_bytes="0",
                                    cpu_bytes=str(2 * prefix_bytes + 2 * n * block + (64 << 20)), timeout=120)
    return out


def connect(daemons: dict, paths: list[str], report: dict) -> dict:
    """path -> N -> Client over that path (paths some daemon cannot give are skipped, noted)."""
    from kvstore.client import Client

    out: dict = {}
    for path in paths:
        per = {n: Client(d.address, transport=path, timeout_s=120) for n, d in daemons.items()}
        if any(c.active_transport != path for c in per.values()):
            report.setdefault("skipped", []).append(f"{path}: not negotiated")
            for c in per.values():
                c.close()
            continue
        out[path] = per
    return out


def run_model(model: str, chunks: list[int], reps: int, paths: list[str], slots: str, report: dict) -> dict:
    from kvstore.connectors.vllm.chunks import ChunkPacking
    from kvstore.connectors.vllm.paged_blocks import PagedBlocks
    from kvstore.keys import ChainHasher, KVLayout, Namespace
    from kvstore.ops.ceilings import MemcpyPass, TcpPass

    layers, heads, dim = MODELS[model]
    page = 2 * VLLM_BLOCK * heads * dim * 2
    block = layers * page
    prefix_bytes = PREFIX // VLLM_BLOCK * block
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, prefix_bytes, dtype=np.uint8)
    staging = np.zeros(prefix_bytes, dtype=np.uint8)
    tokens = np.arange(PREFIX) + 11
    memcpy = MemcpyPass(block, working_set=prefix_bytes, cold_sources=True)
    tcp = TcpPass(block, PREFIX // VLLM_BLOCK)
    # vLLM's paged cache for the prefix (FlashInfer-shaped pages, block index first), blocks shuffled
    nb = PREFIX // VLLM_BLOCK
    kv = {f"l{i}": torch.zeros(nb, 2, VLLM_BLOCK, heads, dim, dtype=torch.bfloat16) for i in range(layers)}
    paged = PagedBlocks(kv, list(kv), nb)
    block_ids = np.random.default_rng(2).permutation(nb).tolist()
    out: dict = {"layers": layers, "kv_heads": heads, "head_dim": dim, "vllm_block_bytes": block,
                 "prefix_bytes": prefix_bytes, "paths": {}}
    with tempfile.TemporaryDirectory(prefix="kvstore-chunking-", ignore_cleanup_errors=True) as workdir:
        daemons = start_daemons(workdir, block, prefix_bytes, chunks, slots)
        clients = connect(daemons, paths, report)
        try:
            for path, per in clients.items():
                setup = {}
                for n in chunks:
                    c = per[n]
                    lay = KVLayout(model=f"bench/{model}", num_layers=layers, num_kv_heads=heads, head_dim=dim,
                                   dtype="bfloat16", block_tokens=n * VLLM_BLOCK, layout="layer,kv,token,head,dim",
                                   block_bytes=n * block)
                    ns_id = c.register_namespace(Namespace(lay, cache_salt=f"chunking-{path}"))
                    hashes = ChainHasher(seed=0).chain(tokens, n * VLLM_BLOCK)
                    rows = [data[i * n * block:(i + 1) * n * block] for i in range(len(hashes))]
                    assert c.put(ns_id, hashes, rows) == ["stored"] * len(hashes)
                    outs = [staging[i * n * block:(i + 1) * n * block] for i in range(len(hashes))]
                    packing = ChunkPacking(lay, [page] * layers, [(2, VLLM_BLOCK, heads, dim)] * layers, n)
                    setup[n] = (ns_id, hashes, outs, packing)
                ceiling = memcpy if path == "shm" else tcp
                samples = {n: {"lookup": [], "get": [], "place": [], "ceiling": []} for n in chunks}
                for r in range(reps + 1):          # repetition 0 warms connections and buffers
                    for n in chunks:
                        ns_id, hashes, outs, packing = setup[n]
                        c_s = ceiling() * prefix_bytes / ceiling.bytes
                        lk, get = fetch_pass(per[n], ns_id, hashes, outs)
                        t = time.perf_counter()
                        rows = torch.from_numpy(staging).view(len(hashes), -1)
                        if n == 1:
                            paged.scatter(block_ids, rows)
                        else:
                            plan = packing.placement(block_ids, len(hashes), paged.device)
                            for i in range(layers):
                                packing.place_layer(paged, i, rows, plan)
                        place = time.perf_counter() - t
                        if r:
                            for k, v in (("lookup", lk), ("get", get), ("place", place), ("ceiling", c_s)):
                                samples[n][k].append(v)
                assert np.array_equal(staging, data)
                check = paged.host_buffer(nb)
                paged.gather(block_ids, check)   # the last N placed the prefix's blocks where they belong
                packing = setup[chunks[-1]][3]
                assert torch.equal(check, packing.to_blocks(torch.from_numpy(data).view(nb // packing.n, -1)))
                rows_out = {}
                for n in chunks:
                    s = samples[n]
                    total = [a + b + u for a, b, u in zip(s["lookup"], s["get"], s["place"])]
                    rows_out[n] = {"kvstore_blocks": len(setup[n][1]), "chunk_bytes": n * block,
                                   **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in s.items()},
                                   "total_ms": statistics.median(total) * 1e3,
                                   "ceiling_vs_total": statistics.median(cs / t for cs, t in zip(s["ceiling"], total)),
                                   "ceiling_vs_get": statistics.median(cs / g for cs, g in zip(s["ceiling"], s["get"]))}
                for n in chunks:
                    rows_out[n]["total_vs_1"] = rows_out[n]["total_ms"] / rows_out[chunks[0]]["total_ms"]
                    rows_out[n]["get_vs_1"] = rows_out[n]["get_ms"] / rows_out[chunks[0]]["get_ms"]
                for n, (ns_id, hashes, _, _) in setup.items():
                    per[n].delete(ns_id, hashes)
                out["paths"][path] = {"ceiling": "memcpy (cold)" if path == "shm" else "raw TCP", "chunks": rows_out}
        finally:
            tcp.close()
            for per in clients.values():
                for c in per.values():
                    c.close()
            for d in daemons.values():
                d.stop(timeout=30)
    return out


def markdown(report: dict) -> str:
    from kvstore.ops.report import machine_line

    m = report["machine"]
    out = ["# vLLM connector chunking (benchmarks/bench_vllm_chunking.py)", "",
           machine_line(m, "grpcio", "torch", load=(m["load_avg_1m"], report["load_avg_end"]))
           + " (shared machine: read ratios). Daemon: "
           f"{report['daemon']}. One fetch = the scheduler's lookup of the {PREFIX}-token chain + the worker's "
           f"get_into of every block into one staging buffer + placing every layer into vLLM's paged KV tensors "
           f"({VLLM_BLOCK}-token FlashInfer-shaped pages, block ids shuffled; N = 1: PagedBlocks.scatter, N > 1: "
           f"ChunkPacking.place_layer straight out of the chunks; one torch thread). Medians of {report['reps']} "
           "repetitions, the N's interleaved in each; each pass right after one ceiling pass moving the same bytes "
           "(shm: memcpy with neither side in the caches; bulk / grpc: raw TCP over one loopback connection).", ""]
    for model, r in report["models"].items():
        out += [f"## {model}: {r['layers']} layers, {r['kv_heads']} KV heads x {r['head_dim']}, bf16 "
                f"({r['vllm_block_bytes'] >> 10} KiB per vLLM block, {r['prefix_bytes'] >> 20} MiB per prefix)", "",
                "| path | N | kvstore blocks | lookup ms | get ms | place ms | fetch ms | fetch vs N=1 | "
                "get vs N=1 | ceiling ms | ceiling / fetch | ceiling / get |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for path, p in r["paths"].items():
            for n, row in p["chunks"].items():
                out.append(f"| {path} | {n} | {row['kvstore_blocks']} | {row['lookup_ms']:.2f} | {row['get_ms']:.1f} | "
                           f"{row['place_ms']:.1f} | {row['total_ms']:.1f} | {row['total_vs_1']:.2f}x | "
                           f"{row['get_vs_1']:.2f}x | {p['ceiling']} {row['ceiling_ms']:.1f} | "
                           f"{row['ceiling_vs_total']:.2f}x | {row['ceiling_vs_get']:.2f}x |")
        out.append("")
    out += ["ceiling / fetch: the fraction of the ceiling's speed the whole fetch reached (1 = as fast as "
            "moving the bytes raw). fetch vs N=1 < 1: chunks of N blocks fetch the prefix faster than one block each."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,llama3-8b,llama3.2-1b",
                    help="KV shapes (the bytes are random): the real model's, and two larger Llamas'")
    ap.add_argument("--chunks", default="1,4,16")
    ap.add_argument("--paths", default="shm,bulk,grpc")
    ap.add_argument("--slots", default="block", choices=["block", "default"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_chunking"))
    args = ap.parse_args()
    from kvstore.ops.cli import reexec_with_malloc_tuning

    reexec_with_malloc_tuning(sys.argv)
    from kvstore.ops.machine import machine_facts
    from kvstore.ops.report import write_report

    # one thread for the copies: on 2 cores shared with the daemon, torch's second OpenMP thread
    # waits for a core at every barrier and turned 13 ms placements into 50-180 ms ones
    torch.set_num_threads(1)
    chunks = [int(n) for n in args.chunks.split(",")]
    report = {"machine": machine_facts(), "reps": args.reps, "prefix_tokens": PREFIX, "vllm_block_tokens": VLLM_BLOCK,
              "daemon": "one private child process per N, CPU tier only, slot = "
                        + ("the kvstore block (chunk) size" if args.slots == "block" else "the default 256 KiB"),
              "models": {}}
    t0 = time.time()
    for model in args.models.split(","):
        report["models"][model] = run_model(model, chunks, args.reps, args.paths.split(","), args.slots, report)
    report["seconds"] = round(time.time() - t0, 1)
    report["load_avg_end"] = os.getloadavg()[0]
    write_report(args.out, report, markdown)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Codec speed on this CPU, against memcpy measured in the same run, and what it buys.

    .venv/bin/python benchmarks/bench_codecs.py [--threads 1 2] [--out benchmarks/results] [--disk-dir DIR]
        [--codecs int4_g64 int4_g64_t0]   # only these (a pair measured side by side)

For a Llama-3-8B-sized block (32 layers, 8 KV heads, head_dim 128, 16 tokens, bf16 = 2 MiB) and
each codec: encode and decode throughput in GB/s of *raw* block bytes (best of several rounds,
so a busy shared machine shows its ceiling, plus the median), on 1 and 2 threads (torch's and the
compiled kernels' alike: ``fast_runner.threads_at_most``). Two
memcpy ceilings with the same threads, measured in the same run: one block copied over and over
(cache-resident, "hot"), and a memory-bound memcpy — 2 MiB copies walking a source and a
destination of 256 MiB each, larger than the caches — which codec speeds are quoted against.
Then the effect on a tier: blocks that fit in a fixed CPU budget, and the time to read one block
from disk (O_DIRECT, measured here) plus decode, against reading it raw — which is what decides
whether a codec pays for itself on the NVMe tier. That is an estimate (a disk ceiling plus the
kernel's decode time); ``bench_nvme_codecs.py`` measures it through a real Store and NvmeTier.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvstore.codecs.base as codec_base
from kvstore.codecs import CODEC_IDS, decode_block, encode_block, fast_runner, warm_up
from kvstore.keys import KVLayout
from kvstore.ops.ceilings import touched_buffer

CPU_BUDGET = 64 << 30
#: source and destination of the memory-bound memcpy: each well beyond this machine's caches
MEMORY_BOUND_BYTES = 256 << 20


def block_layout(tokens: int) -> KVLayout:
    return KVLayout("bench/llama-3-8b-like", num_layers=32, num_kv_heads=8, head_dim=128,
                    dtype="bfloat16", block_tokens=tokens, layout="kv,layer,token,head,dim")


def realistic_block(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    """K with outlier channels, V with per-token scale (as in fidelity.py), as block bytes."""
    g = torch.Generator().manual_seed(seed)
    L, T, H, D = layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim
    k = torch.randn(L, T, H, D, generator=g)
    k[..., :4] = k[..., :4] * 5 + 30
    v = torch.randn(L, T, H, D, generator=g) * torch.exp(torch.randn(L, T, H, 1, generator=g) * 0.5)
    return torch.stack((k, v)).to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)


def timed(fn, rounds: int, min_seconds: float = 0.3) -> tuple[float, float]:
    """(best, median) seconds per call."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < rounds or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) > 200:
            break
    return min(times), statistics.median(times)


class MemoryBoundCopy:
    """Copies of one block-sized chunk (torch ``copy_``, the threads torch is set to), each from the
    next chunk of a ``MEMORY_BOUND_BYTES`` source to the next of as large a destination: no chunk is
    in cache when it is copied, so this is what memory bandwidth allows a block copy."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.frombuffer(touched_buffer(MEMORY_BOUND_BYTES), dtype=torch.uint8)
        self.dst = torch.frombuffer(touched_buffer(MEMORY_BOUND_BYTES, fill=0), dtype=torch.uint8)
        self.nbytes, self.chunks, self.i = nbytes, MEMORY_BOUND_BYTES // nbytes, 0

    def __call__(self) -> None:
        a = (self.i % self.chunks) * self.nbytes
        b = ((self.i * 7 + 3) % self.chunks) * self.nbytes   # another walk for the destination
        self.dst[b:b + self.nbytes].copy_(self.src[a:a + self.nbytes])
        self.i += 1


def disk_read_gbps(directory: Path, nbytes: int, chunk: int) -> tuple[float, str]:
    """Read throughput of ``directory``'s device for ``chunk``-sized reads, page cache bypassed."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="kvstore-bench-")
    try:
        data = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        try:
            rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            how = "O_DIRECT"
        except OSError:
            rfd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            how = "buffered after FADV_DONTNEED"
        try:
            t = time.perf_counter()
            for i in range(nbytes // chunk):
                os.preadv(rfd, [buf], i * chunk)
            return nbytes / (time.perf_counter() - t) / 1e9, how
        finally:
            os.close(rfd)
            buf.close()
    finally:
        os.unlink(path)


def run(threads: list[int], tokens: int, disk_dir: Path, device: str, reference: bool = False,
        codecs: list[str] | None = None) -> dict:
    warm_up()   # (until the kernels are compiled, the codecs run the reference: it would be measured)
    layout = block_layout(tokens)
    raw = realistic_block(layout).to(device)
    nbytes = layout.block_bytes
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    bound_copy = MemoryBoundCopy(nbytes) if device == "cpu" else None
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        with fast_runner.threads_at_most(n_threads):   # (the compiled kernels' threads, as torch's)
            dst = torch.empty_like(raw)
            best, med = timed(lambda: (dst.copy_(raw), sync()), 20)
            rows.append({"threads": n_threads, "codec": "memcpy, hot (one block, cache-resident)",
                         "encode_gbps": nbytes / best / 1e9, "decode_gbps": nbytes / best / 1e9,
                         "encode_gbps_median": nbytes / med / 1e9, "decode_gbps_median": nbytes / med / 1e9,
                         "payload_bytes": nbytes})
            hot = rows[-1]
            memcpy = hot["encode_gbps"]
            if bound_copy is not None:
                best, med = timed(bound_copy, 50)
                memcpy = nbytes / best / 1e9
                rows.append({"threads": n_threads, "codec": "memcpy, memory-bound (256 MiB source and destination)",
                             "encode_gbps": memcpy, "decode_gbps": memcpy, "encode_gbps_median": nbytes / med / 1e9,
                             "decode_gbps_median": nbytes / med / 1e9, "payload_bytes": nbytes,
                             "encode_vs_memcpy": 1.0, "decode_vs_memcpy": 1.0})
            hot["encode_vs_memcpy"] = hot["decode_vs_memcpy"] = hot["encode_gbps"] / memcpy
            variants = [(c, not reference) for c in (codecs or CODEC_IDS) if c != "raw"]
            if device == "cpu" and not reference and not codecs:  # the eager-torch reference, to show what the compiled kernels buy
                variants += [("fp8", False), ("int4_g32", False)]
            for codec, fast in variants:
                codec_base.USE_FAST = fast
                cid, payload = encode_block(codec, raw, layout)
                e_best, e_med = timed(lambda: encode_block(codec, raw, layout), 5)
                d_best, d_med = timed(lambda: (decode_block(cid, payload, layout, out=dst), sync()), 5)
                assert codec not in ("zstd",) or torch.equal(dst, raw)
                label = codec if fast or device != "cpu" else f"{codec} (eager torch reference)"
                row = {"threads": n_threads, "codec": label, "payload_bytes": int(payload.nbytes),
                       "encode_gbps": nbytes / e_best / 1e9, "decode_gbps": nbytes / d_best / 1e9,
                       "encode_gbps_median": nbytes / e_med / 1e9, "decode_gbps_median": nbytes / d_med / 1e9,
                       "decode_s": d_best}
                row["encode_vs_memcpy"] = row["encode_gbps"] / memcpy
                row["decode_vs_memcpy"] = row["decode_gbps"] / memcpy
                rows.append(row)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
    codec_base.USE_FAST = True
    # plain zstd on unshuffled bytes, to show what the byte-plane split buys
    import zstandard
    plain = len(zstandard.ZstdCompressor(level=1).compress(raw.cpu().numpy()))
    disk_gbps, how = disk_read_gbps(disk_dir, 256 << 20, nbytes)
    tier = []
    best_threads = max(threads)
    for r in rows:
        if r["threads"] != best_threads or r["codec"] not in CODEC_IDS:
            continue
        read_s = r["payload_bytes"] / (disk_gbps * 1e9)
        tier.append({"codec": r["codec"], "ratio": nbytes / r["payload_bytes"],
                     "blocks_in_64GiB_cpu": CPU_BUDGET // r["payload_bytes"],
                     "disk_read_ms": read_s * 1e3, "decode_ms": r["decode_s"] * 1e3,
                     "read_plus_decode_ms": (read_s + r["decode_s"]) * 1e3})
    raw_read_ms = nbytes / (disk_gbps * 1e9) * 1e3
    tier.insert(0, {"codec": "raw", "ratio": 1.0, "blocks_in_64GiB_cpu": CPU_BUDGET // nbytes,
                    "disk_read_ms": raw_read_ms, "decode_ms": 0.0, "read_plus_decode_ms": raw_read_ms})
    return {"device": device, "block": {"layout": layout.to_dict(), "bytes": nbytes}, "rows": rows, "tier": tier,
            "disk": {"read_gbps": disk_gbps, "how": how, "dir": str(disk_dir)},
            "zstd_plain_ratio": nbytes / plain}


def cpu_vector_flags() -> str:
    """The SIMD extensions the compiled kernels can use on this CPU (they decide its codec speed)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512fp16", "amx_bf16") if f in flags)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    from kvstore.ops.machine import machine_facts
    return {"cpu": machine_facts().get("cpu_model") or platform.processor() or platform.machine(),
            "cpu_flags": cpu_vector_flags(), "cores": os.cpu_count(),
            "loadavg_at_start": load_average(), "python": platform.python_version(), "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


#: issue #34's codecs, whose speed goals the markdown states
NEW_CODECS = ("int8_had", "int4_g64_k16_had", "int8_kchan", "int4_g64_t0")


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def write_markdown(res: dict, path: Path) -> None:
    m = res["machine"]
    lines = [f"# Codec speed ({res['device']})", "", "Produced by `python benchmarks/bench_codecs.py`. Machine: "
             + ", ".join(f"{k}={v}" for k, v in m.items()), "",
             f"Block: {res['block']['bytes'] / 2**20:.1f} MiB bf16 (32 layers, 8 KV heads, head_dim 128, "
             f"{res['block']['layout']['block_tokens']} tokens). GB/s of raw block bytes, best of "
             "several rounds (median in brackets). Ratios are to the memory-bound memcpy of the same "
             "threads (2 MiB copies walking 256 MiB source and destination buffers, beyond the caches), "
             "measured in the same run; the hot memcpy (one block copied over and over) is shown too. "
             f"Load average (1, 5, 15 min) at the start {m['loadavg_at_start']}, at the end "
             f"{res.get('loadavg_at_end')}: the machine is shared, read the ratios and the best figures.", "",
             "| threads | codec | payload | encode GB/s | decode GB/s | encode / mem-bound memcpy "
             "| decode / mem-bound memcpy |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        enc = f"{r['encode_gbps']:.2f} ({r['encode_gbps_median']:.2f})"
        dec = f"{r['decode_gbps']:.2f} ({r['decode_gbps_median']:.2f})"
        lines.append(f"| {r['threads']} | {r['codec']} | {r['payload_bytes']} | {enc} | {dec} | "
                     f"{r.get('encode_vs_memcpy', 1):.3f} | {r.get('decode_vs_memcpy', 1):.3f} |")
    goals = {"fp8": (5, 12), "int4_g64": (4, 6)}   # issue #16, 2 threads, GB/s
    lines += ["", "Goals (issue #16: 2 MiB block, 2 threads), best of the rounds above:", ""]
    for r in res["rows"]:
        if r["threads"] == 2 and r["codec"] in goals:
            enc, dec = goals[r["codec"]]
            lines.append(f"- {r['codec']}: encode {r['encode_gbps']:.2f} GB/s (goal >= {enc}, "
                         f"{'met' if r['encode_gbps'] >= enc else 'not met'}), decode {r['decode_gbps']:.2f} GB/s "
                         f"(goal >= {dec}, {'met' if r['decode_gbps'] >= dec else 'not met'})")
    lines += ["", "Goals (issue #34), best of the rounds above: the new codecs' encode and decode within 20 % of "
              "int4_g64's (>= 0.8x), decode >= 0.7x the memory-bound memcpy of the same threads:", ""]
    int4 = {r["threads"]: r for r in res["rows"] if r["codec"] == "int4_g64"}
    memcpy = {r["threads"]: r["decode_gbps"] for r in res["rows"] if r["codec"].startswith("memcpy, memory-bound")}
    for r in res["rows"]:
        if r["codec"] in NEW_CODECS and r["threads"] in int4:
            enc, dec = (r[k] / int4[r["threads"]][k] for k in ("encode_gbps", "decode_gbps"))
            vs = f"{r['decode_vs_memcpy']:.2f}x memcpy ({_met(r['decode_vs_memcpy'] >= 0.7)})"
            if memcpy and memcpy.get(r["threads"], 0) < max(memcpy.values()) / 2:   # (a thread descheduled)
                vs = f"not judged: this memcpy ran at {memcpy[r['threads']]:.2f} GB/s, under half another row's"
            lines.append(f"- {r['threads']} thread(s), {r['codec']}: encode {enc:.2f}x ({_met(enc >= 0.8)}), decode "
                         f"{dec:.2f}x ({_met(dec >= 0.8)}) int4_g64's; decode {vs}")
    d = res["disk"]
    lines += ["", f"zstd on plain (not byte-plane split) bytes: ratio {res['zstd_plain_ratio']:.3f}.", "",
              f"## Effect on tiers (disk read {d['read_gbps']:.2f} GB/s, {d['how']}, measured in {d['dir']})",
              "", "| codec | ratio | blocks in 64 GiB CPU | disk read ms | decode ms | read + decode ms |",
              "|---|---|---|---|---|---|"]
    for t in res["tier"]:
        lines.append(f"| {t['codec']} | {t['ratio']:.2f}x | {t['blocks_in_64GiB_cpu']} | {t['disk_read_ms']:.3f} "
                     f"| {t['decode_ms']:.3f} | {t['read_plus_decode_ms']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--disk-dir", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--device", default="cpu",
                    help="cuda: raw block and decode buffer on the GPU (encode = torch on the GPU + "
                         "payload to host; decode = payload to GPU + torch on the GPU)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--reference", action="store_true",
                    help="every codec through the eager torch reference (the CUDA path), not numba")
    ap.add_argument("--codecs", nargs="+", choices=sorted(CODEC_IDS),
                    help="only these codecs (default: every one, and the eager reference of fp8 and int4_g32)")
    args = ap.parse_args()
    res = {"machine": machine(), **run(args.threads, args.tokens, args.disk_dir, args.device, args.reference,
                                       args.codecs)}
    res["loadavg_at_end"] = load_average()
    stem = "codecs" if args.device == "cpu" else f"codecs_{args.device.split(':')[0]}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    write_markdown(res, args.out / f"{stem}.md")
    print((args.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()

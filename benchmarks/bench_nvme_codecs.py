"""NVMe tier with a codec at rest, measured through the real tier: read + decode GB/s beside raw.

    .venv/bin/python benchmarks/bench_nvme_codecs.py [--codecs raw,fp8,int4_g64,zstd] [--blocks 64]
        [--rounds 7] [--threads 2] [--dir DIR] [--out benchmarks/results/nvme_codecs]

``bench_codecs.py`` estimates read + decode from a disk ceiling; this measures it. Per codec, a
Store of a small CPU tier over a real ``NvmeTier`` (``codecs: {nvme: <codec>}``, the CPU tier raw)
takes ``--blocks`` distinct 2 MiB bf16 blocks (Llama-3-8B-like: 32 layers, 8 KV heads, head_dim
128, 16 tokens; K with outlier channels, V with per-token scale, as in bench_codecs.py). Filler
blocks push every one of them out of the CPU tier: they are demoted, i.e. encoded and written to
NVMe by the store's own demotion path. They are then read back with ``Store.get_into`` (promotion
off, so every read comes from NVMe: the tier's O_DIRECT read, its xxh3 check, the codec's decode)
into page-aligned buffers, all blocks per round; GB/s are *raw-equivalent* (block bytes delivered
per second, GB = 1e9 bytes), best and median of ``--rounds``, the codecs' rounds interleaved so a
change in a shared machine's load hits them alike. O_DIRECT bypasses the page cache, as
the tier does where the filesystem allows it (reported). The raw O_DIRECT read ceiling of the same
directory (2 MiB reads of a 256 MiB file) is measured in the same run for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script: its own directory is sys.path[0], so the sibling benchmark imports as a module
from bench_codecs import block_layout, disk_read_gbps, realistic_block  # noqa: E402

CPU_BLOCKS = 2   # the CPU tier holds this many blocks; everything else is demoted to NVMe


def aligned(nbytes: int) -> np.ndarray:
    from kvstore.ops.ceilings import touched_buffer
    return np.frombuffer(touched_buffer(nbytes, fill=0), dtype=np.uint8)[:nbytes]


class CodecStore:
    """One codec's store: a 2-block CPU tier over an NvmeTier with that codec, its blocks demoted."""

    def __init__(self, codec: str, blocks: list[torch.Tensor], directory: str) -> None:
        from kvstore.keys import ChainHasher, Namespace
        from kvstore.store import Store, StoreConfig
        from kvstore.tiers.cpu import CpuTier
        from kvstore.tiers.nvme import NvmeTier

        self.codec, self.layout = codec, block_layout(16)
        nbytes = self.layout.block_bytes
        n = len(blocks)
        self.path = tempfile.mkdtemp(prefix=f"kvstore-bench-nvme-{codec}-", dir=directory)
        self.nvme = NvmeTier(os.path.join(self.path, "nvme"), (n + 16) * nbytes)
        self.store = Store([CpuTier(CPU_BLOCKS * nbytes, slot_bytes=1 << 20), self.nvme],
                           StoreConfig(tier_codecs={} if codec == "raw" else {"nvme": codec}, promote_on_hit=False))
        tokens = self.layout.block_tokens
        self.ns = self.store.register_namespace(Namespace(self.layout, cache_salt=f"bench-nvme-{codec}"))
        self.hashes = ChainHasher(seed=1).chain(np.arange(n * tokens), tokens)
        t = time.perf_counter()
        self.store.put(self.ns, self.hashes, [b.numpy() for b in blocks])
        fillers = ChainHasher(seed=2).chain(np.arange(4 * CPU_BLOCKS * tokens), tokens)
        self.store.put(self.ns, fillers, [blocks[i % n].numpy() for i in range(len(fillers))])
        self.nvme.sync()
        self.write_gbps = (n + len(fillers)) * nbytes / (time.perf_counter() - t) / 1e9
        where = self.store.lookup(self.ns, self.hashes, lease=False).tiers
        assert where == ["nvme"] * n, f"{codec}: not every block was demoted: {where}"
        records = {r.block_hash: r for r in self.nvme.records()}
        self.stored = sum(records[h].stored_size for h in self.hashes)
        self.codec_ids = sorted({records[h].codec for h in self.hashes})
        self.outs = [aligned(nbytes) for _ in self.hashes]
        self.blocks = blocks
        self.times: list[float] = []

    def read_round(self) -> float:
        t = time.perf_counter()
        got = self.store.get_into(self.ns, self.hashes, self.outs)
        elapsed = time.perf_counter() - t
        assert got == [self.layout.block_bytes] * len(self.hashes), got
        return elapsed

    def check(self) -> None:
        """What came back is the codec's decoding of each block (raw and zstd: the block itself),
        and every read was an NVMe hit."""
        from kvstore.codecs import decode_block, encode_block
        for b, out in zip(self.blocks, self.outs):
            want = b.numpy() if self.codec == "raw" else \
                decode_block(*encode_block(self.codec, b, self.layout), self.layout).numpy()
            assert np.array_equal(out, want), self.codec
        counters = self.store.stats()["counters"]
        assert counters["hits_nvme"] == len(self.hashes) * (len(self.times) + 1), counters

    def result(self) -> dict:
        n, nbytes = len(self.hashes), self.layout.block_bytes
        best, med = min(self.times), statistics.median(self.times)
        return {"codec": self.codec, "blocks": n, "block_bytes": nbytes, "stored_bytes": self.stored,
                "ratio": n * nbytes / self.stored, "stored_codec_ids": self.codec_ids, "o_direct": self.nvme.o_direct,
                "read_gbps": n * nbytes / best / 1e9, "read_gbps_median": n * nbytes / med / 1e9,
                "ms_per_block": best / n * 1e3, "ms_per_block_median": med / n * 1e3,
                "write_gbps": self.write_gbps, "rounds_s": self.times}

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.path, ignore_errors=True)


def markdown(report: dict) -> str:
    from kvstore.ops.report import machine_line

    m = report["machine"]
    raw = next((r for r in report["results"] if r["codec"] == "raw"), None)
    lines = ["# NVMe tier with a codec at rest (benchmarks/bench_nvme_codecs.py)", "",
             machine_line(m, "torch", "numpy", directory=True, load=(report["load_before"], report["load_after"]))
             + f"; torch threads {report['torch_threads']}. {report['date_utc']} UTC. The machine is shared: read the ratios to raw.",
             "",
             f"{report['blocks']} distinct blocks of 2 MiB (bf16, 32 layers x 16 tokens x 8 KV heads x 128) per "
             "codec, demoted by the store from a 2-block CPU tier into a real NvmeTier whose codec is the "
             "row's (the store's demotion path encodes them), then read back with Store.get_into, promotion "
             "off, so every read is the tier's O_DIRECT read + xxh3 check + the codec's decode into a "
             f"page-aligned buffer. All blocks per round, {report['rounds']} rounds after a warm-up, the codecs' "
             "rounds interleaved; GB/s are "
             "raw-equivalent (block bytes delivered per second, GB = 1e9 bytes), best (median). Raw O_DIRECT "
             f"read ceiling of the same directory, same run: {report['disk_ceiling_gbps']:.2f} GB/s "
             "(2 MiB reads of a 256 MiB file).", "",
             "| codec | on NVMe | ratio | read + decode GB/s | ms per block | vs raw | put + demote GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        vs = f"{r['read_gbps'] / raw['read_gbps']:.2f}x" if raw else "-"
        lines.append(f"| {r['codec']} | {r['stored_bytes'] / 2**20:.1f} MiB | {r['ratio']:.2f}x | "
                     f"{r['read_gbps']:.2f} ({r['read_gbps_median']:.2f}) | {r['ms_per_block']:.3f} "
                     f"({r['ms_per_block_median']:.3f}) | {vs} | {r['write_gbps']:.2f} |")
    lines += ["", "A codec at rest reads fewer bytes from the disk and pays a decode on the CPU (and, for a "
              "payload that is not a whole number of 4 KiB pages, a copy out of the tier's staging buffer): it "
              "beats raw where decoding a block costs less than reading the bytes it saves. `put + demote` "
              "is the whole write phase (puts into the CPU tier, demotion with the encode, the NVMe write "
              "and one sync), for context only."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="raw,fp8,int4_g64,zstd")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=HERE, help="where the NVMe tier's directory is made (a real disk)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "nvme_codecs"))
    args = ap.parse_args()
    from kvstore.codecs import warm_up
    from kvstore.ops.machine import machine_facts

    torch.set_num_threads(args.threads)
    warm_up()
    layout = block_layout(16)
    blocks = [realistic_block(layout, seed=s) for s in range(args.blocks)]
    report = {"machine": machine_facts(args.dir), "torch_threads": torch.get_num_threads(), "blocks": args.blocks,
              "rounds": args.rounds, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "load_before": round(os.getloadavg()[0], 2), "results": []}
    report["disk_ceiling_gbps"] = disk_read_gbps(pathlib.Path(args.dir), 256 << 20, layout.block_bytes)[0]
    stores = [CodecStore(codec, blocks, args.dir) for codec in args.codecs.split(",")]
    try:
        for s in stores:
            s.read_round()   # warm-up: kernels, staging buffers, the reader pool
        for _ in range(args.rounds):   # codecs interleaved: a change in the machine's load hits them all
            for s in stores:
                s.times.append(s.read_round())
        for s in stores:
            s.check()
            r = s.result()
            report["results"].append(r)
            print(f"{s.codec}: {r['ratio']:.2f}x, read + decode {r['read_gbps']:.2f} GB/s (median "
                  f"{r['read_gbps_median']:.2f}), {r['ms_per_block']:.3f} ms/block, O_DIRECT {r['o_direct']}",
                  file=sys.stderr, flush=True)
    finally:
        for s in stores:
            s.close()
    report["load_after"] = round(os.getloadavg()[0], 2)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

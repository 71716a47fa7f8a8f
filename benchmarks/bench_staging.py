#!/usr/bin/env python3
"""What a load from NVMe costs everyone else: lookups over the daemon's Unix socket (answered
under the store lock) while another client's gets read blocks from the NVMe tier, over shared
memory and over the side channel; writes benchmarks/results/staging.{json,md}.

    .venv/bin/python benchmarks/bench_staging.py [--blocks 512] [--block 1MiB] [--seconds 9] [--dir /var/tmp]

One private daemon (64 MiB CPU arena, NVMe in ``--dir``) holds a chain of ``--blocks`` blocks,
nearly all of them on NVMe only. A loader process gets the whole chain again and again, first over
shared memory (the client copies out of the arena), then over the side channel (the daemon copies
out of the arena onto the socket). Both stage what the arena lacks through the store's
``prepare_load`` (the side channel by ``service.block_reads.pinned_runs``), which reads the
blocks from disk several at once, outside the store lock. Meanwhile this process looks up an
8-block chain once a millisecond over the Unix socket (the lookup index is off, so every lookup
takes the store lock). The same lookups are timed first with the daemon idle, and the loaders' GB/s
are set against raw O_DIRECT reads of files of the block's size in the same directory.
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

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops.ceilings import GB, ODirectReadPass
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, write_report
from kvstore.units import format_size, parse_size

HERE = os.path.dirname(os.path.abspath(__file__))

LOADER = """
import sys, time, numpy as np
from kvstore.client import Client
from kvstore.keys import ChainHasher, KVLayout, Namespace
size, n, seconds = {size}, {n}, {seconds}
c = Client({address!r}, transport={transport!r}, timeout_s=120)
ns = c.register_namespace(Namespace(KVLayout(**{layout!r}), cache_salt="staging"))
hashes = ChainHasher(seed=1).chain(np.arange(16 * n), 16)
outs = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
gets, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    assert c.get_into(ns, hashes, outs) == [size] * n
    gets += 1
print(gets * n * size / (time.perf_counter() - start) / 1e9, flush=True)
"""


def lookups(client, ns: bytes, chain: list[bytes], seconds: float) -> dict:
    """One lookup a millisecond for ``seconds``; latency percentiles in microseconds."""
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        assert client.lookup(ns, chain).num_hit == len(chain)
        lat.append((time.perf_counter() - t) * 1e6)
        time.sleep(0.001)
    lat.sort()
    return {"count": len(lat), "p50_us": statistics.median(lat), "p99_us": lat[int(len(lat) * 0.99)],
            "max_us": lat[-1]}


def run(blocks: int, size: int, seconds: float, directory: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-staging-", dir=directory, ignore_cleanup_errors=True) as work:
        layout = dict(model="bench/staging", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", block_tokens=16,
                      block_bytes=size)
        report = {"machine": machine_facts(), "blocks": blocks, "block_bytes": size, "seconds": seconds,
                  "load_average_start": os.getloadavg()[0]}
        daemon = start_local_daemon(os.path.join(work, "kvd"), "--log-level", "WARNING", cpu_bytes="64MiB",
                                    nvme_bytes=str(4 * blocks * (size + 8192)), nvme_path=os.path.join(work, "nvme"))
        try:
            with daemon.client(transport="shm", timeout_s=120) as c:
                ns = c.register_namespace(Namespace(KVLayout(**layout), cache_salt="staging"))
                rng = np.random.default_rng(0)
                data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(blocks)]
                chain = ChainHasher(seed=1).chain(np.arange(16 * blocks), 16)
                small = ChainHasher(seed=2).chain(np.arange(16 * 8), 16)
                c.put(ns, chain, data)
                c.put(ns, small, data[:8])
                report["tiers_after_put"] = {t: v["blocks"] for t, v in c.stats()["tiers"].items()}
            with daemon.client(lookup_index=False) as lk:
                ns = lk.register_namespace(Namespace(KVLayout(**layout), cache_salt="staging"))
                report["idle"] = lookups(lk, ns, small, seconds)
                for transport in ("shm", "bulk"):
                    loader = subprocess.Popen([sys.executable, "-c", LOADER.format(
                        size=size, n=blocks, seconds=seconds + 2, address=daemon.address, layout=layout,
                        transport=transport)], stdout=subprocess.PIPE, text=True)
                    time.sleep(1.0)   # the loader connected and reading
                    report[f"during_{transport}_loads"] = lookups(lk, ns, small, seconds)
                    out, _ = loader.communicate(timeout=120)
                    report[f"{transport}_loader_get_gbps"] = float(out.strip().splitlines()[-1])
            with ODirectReadPass(work, size, min(blocks, 128)) as raw:
                raw()
                report["raw_odirect_read_gbps"] = statistics.median(raw.bytes / raw() / GB for _ in range(5))
        finally:
            daemon.stop()
    report["load_average_end"] = os.getloadavg()[0]
    return report


def markdown(r: dict) -> str:
    m = r["machine"]
    idle, shm, bulk = r["idle"], r["during_shm_loads"], r["during_bulk_loads"]
    rows = "\n".join(f"| {name} | {x['count']} | {x['p50_us']:.0f} | {x['p99_us']:.0f} | {x['max_us']:.0f} |"
                     for name, x in (("daemon idle", idle), ("during the shared-memory loader's gets", shm),
                                     ("during the side-channel loader's gets", bulk)))
    raw = r["raw_odirect_read_gbps"]
    return f"""# Lookups while another client loads blocks from NVMe (benchmarks/bench_staging.py)

{machine_line(m, load=(r['load_average_start'], r['load_average_end']))}; {m.get('time_utc')}. One daemon, 64 MiB CPU arena; {r['blocks']} blocks of {format_size(r['block_bytes'])}, after the put on these tiers: {r['tiers_after_put']}. A loader process gets the whole chain again and again, first over shared memory, then over the side channel; both stage each block the arena lacks from NVMe through the store's prepare_load (disk reads several at once, outside the store lock). Meanwhile an 8-block chain is looked up once a millisecond over the Unix socket (lookup index off: every lookup takes the store lock), {r['seconds']:g} s per row.

| daemon | lookups | p50 us | p99 us | max us |
|---|---|---|---|---|
{rows}

Lookup p50 / p99 against the idle daemon: {shm['p50_us'] / idle['p50_us']:.1f}x / {shm['p99_us'] / idle['p99_us']:.1f}x during shared-memory loads, {bulk['p50_us'] / idle['p50_us']:.1f}x / {bulk['p99_us'] / idle['p99_us']:.1f}x during side-channel loads. The loaders' gets: shared memory {r['shm_loader_get_gbps']:.2f} GB/s ({r['shm_loader_get_gbps'] / raw:.2f}x), side channel {r['bulk_loader_get_gbps']:.2f} GB/s ({r['bulk_loader_get_gbps'] / raw:.2f}x) of raw O_DIRECT reads of {format_size(r['block_bytes'])} files in the same directory, one at a time ({raw:.2f} GB/s).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block", default="1MiB")
    ap.add_argument("--seconds", type=float, default=9.0)
    ap.add_argument("--dir", default="/var/tmp", help="where the NVMe tier and the O_DIRECT ceiling write")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "staging"))
    a = ap.parse_args()
    write_report(a.out, run(a.blocks, parse_size(a.block, "block"), a.seconds, a.dir), markdown)


if __name__ == "__main__":
    main()

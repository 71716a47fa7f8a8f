"""LMCache's own L2 benchmark (`lmcache bench l2`): kvstore's plugin adapter vs LMCache's Redis adapter.

Same run, same machine, same object sizes: LMCache's CLI drives each adapter (store, lookup,
load; round-trip verification on), once with kvstore's plugin against a fresh kvstore daemon
and once with LMCache's native RESP adapter against the Redis at 127.0.0.1:6379. The memcpy
and TCP-loopback ceilings are measured in the same run.

    .venv/bin/python benchmarks/bench_lmcache_l2.py      # writes results/lmcache_l2.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

from kvstore.ops import ceilings
from kvstore.ops.engines import engine_env, engine_venv
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES_KB = (256, 4096)
BYTES_PER_ROUND = 64 << 20
ROUNDS = 3
REDIS = ("127.0.0.1", 6379)
ENGINE_VENV_BUILDER = os.path.join(REPO, "scripts", "engine-venv.sh")


def bench(venv: str, adapter: dict, size_kb: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{adapter['type']}-{size_kb}.json")
    num_keys = max(1, BYTES_PER_ROUND // (size_kb << 10))
    env = engine_env()
    proc = subprocess.run([os.path.join(venv, "bin", "lmcache"), "bench", "l2", "--l2-adapter", json.dumps(adapter),
                           "--num-keys", str(num_keys), "--data-size-kb", str(size_kb), "--rounds", str(ROUNDS),
                           "--no-skip-verify", "--lookup-max-hit-rate", "1.0", "--format", "json",
                           "--output", out], capture_output=True, text=True, env=env, cwd=tmp)
    if proc.returncode != 0:
        raise SystemExit(f"lmcache bench l2 failed for {adapter['type']}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    verified = "data verified OK" in proc.stdout + proc.stderr
    metrics = json.load(open(out))["metrics"]
    ops = {v["operation"]: v for k, v in metrics.items() if k.startswith("op_")}
    return {"num_keys": num_keys, "verified": verified,
            **{op.lower(): {"mb_per_s": ops[op]["throughput_avg_mbps"], "ops_per_s": ops[op]["ops_per_sec_avg"],
                            "latency_per_key_ms": ops[op]["latency_per_key_ms"],
                            "success": f"{ops[op]['total_success']}/{ops[op]['total_keys']}"}
               for op in ("Store", "Lookup", "Load")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    venv = engine_venv("lmcache", ENGINE_VENV_BUILDER)
    results: dict = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        d = start_local_daemon(os.path.join(tmp, "kvd"), cpu_bytes="2GiB", nvme_bytes="0")
        try:
            adapters = {
                "kvstore (plugin)": {"type": "plugin", "module_path": "kvstore.connectors.lmcache",
                                     "class_name": "KVStoreL2Adapter", "adapter_params": {"url": d.url}},
                "redis (LMCache resp adapter)": {"type": "resp", "host": REDIS[0], "port": REDIS[1]},
            }
            for size_kb in SIZES_KB:
                for name, spec in adapters.items():
                    results.setdefault(f"{size_kb} KiB", {})[name] = bench(venv, spec, size_kb, tmp)
        finally:
            d.stop()
        data = {"rounds": ROUNDS, "bytes_per_round": BYTES_PER_ROUND, "results": results,
                "ceilings": {"memcpy_gbps_4MiB": ceilings.memcpy_gbps(4 << 20),
                             "tcp_loopback_gbps_4MiB": ceilings.tcp_loopback_gbps(4 << 20)},
                "machine": machine_facts(tmp)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lmcache_l2.json"), "w") as f:
        json.dump(data, f, indent=2)
    md = markdown(data)
    with open(os.path.join(args.out, "lmcache_l2.md"), "w") as f:
        f.write(md)
    print(md)


def markdown(data: dict) -> str:
    m, c = data["machine"], data["ceilings"]
    lines = ["# `lmcache bench l2`: kvstore plugin adapter vs LMCache's Redis adapter", "",
             f"LMCache's own CLI, {data['rounds']} measured rounds of {data['bytes_per_round'] >> 20} MiB each per "
             "operation, round-trip verification on (every run verified). Redis at 127.0.0.1:6379; kvstore daemon "
             "with a 2 GiB shared-memory CPU tier, plugin on its default transport.", "",
             machine_line(m) + f"; memcpy {c['memcpy_gbps_4MiB']:.2f} GB/s, TCP loopback "
             f"{c['tcp_loopback_gbps_4MiB']:.2f} GB/s (4 MiB, same run).",
             "", "| object size | adapter | store MB/s | lookup keys/s | load MB/s | load / memcpy | verified |",
             "|---|---|---:|---:|---:|---:|---|"]
    for size, per in data["results"].items():
        for name, r in per.items():
            lines.append(f"| {size} | {name} | {r['store']['mb_per_s']:.0f} | {r['lookup']['ops_per_s']:.0f} | "
                         f"{r['load']['mb_per_s']:.0f} | {r['load']['mb_per_s'] * 2**20 / 1e9 / c['memcpy_gbps_4MiB']:.2f} | "
                         f"{'yes' if r['verified'] else 'NO'} |")
    lines += ["", "MB/s as LMCache reports it (MiB/s). Shared 2-core machine: compare rows of the same run.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

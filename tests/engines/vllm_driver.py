"""Drive one in-process vLLM engine through a scripted job (run inside the vLLM venv).

    python vllm_driver.py JOB.json RESULT.json

JOB: {"build": {"out_dir": DIR, "layers": 2, ...} (optional: tiny_model.build() first),
      "env": {NAME: VALUE} (optional: set before vLLM is imported, e.g. multiprocessing mode),
      "extra_sys_path": [DIR, ...] (optional: appended to sys.path, after this venv's packages,
                        e.g. another venv's site-packages for LMCache's vLLM-side client),
      "engine": {LLM kwargs: model, block_size, max_model_len, kv_cache_memory_bytes,
                 enable_prefix_caching, ...},
      "kv_transfer_config": {...} | null,
      "steps": [{"generate": [[token ids] | "text", ...], "max_tokens": 8, "timed": false,
                                            # text prompts need the model's tokenizer:
                                            # "engine": {"skip_tokenizer_init": false}
                 "lose_after_lookup": false,   # fault injection, see lose_blocks_after_lookup()
                 "logprobs": null},            # N: also the first generated token's top-N logprobs
                                               # (-1: all of the vocabulary; the engine needs
                                               # "max_logprobs" >= N, or -1)
                {"generate": [[token ids], ...], "logprobs_npy": PATH, "vocab": V, "batch": 16},
                                            # one token per prompt; its log-probabilities over the
                                            # whole vocabulary go to PATH (float32 [prompts, V]),
                                            # not into RESULT (see first_logprobs_to_file())
                {"serve": [[token ids], ...], "max_tokens": 16},  # all arrive at once; per-request
                                            # TTFT and inter-token latency (see serve())
                {"drain": true},            # wait until the kvstore connector's saves reached the daemon
                {"perturb_kv_ulp": SEED},   # every element of the engine's KV cache (bf16) one ulp up or
                                            # down at random (see perturb_kv_ulp()): a yardstick
                {"kill": PID},              # SIGKILL a process (the daemon) between steps
                {"sleep": SECONDS}]}
RESULT: {"steps": [{"outputs": [[ids]], "num_cached_tokens": [n], "seconds": [s],
                    "texts": ["decoded output"], "prompt_tokens": [n] (when the engine has its tokenizer),
                    "first_logprobs": [{token id: logprob}] (with "logprobs")}, ...],
         "connector": {"namespace": {...}, "namespace_id": hex, "worker": {totals}, "scheduler": {totals}}}

Greedy sampling (temperature 0, ignore_eos) so outputs are a deterministic function of the KV.
With ``"timed": true`` prompts run one at a time and ``seconds`` is each one's wall time; with
``max_tokens`` 1 that is the time to first token.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _connectors(llm):
    """(worker connector, scheduler connector) of an in-process engine; None where absent."""
    worker = scheduler = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = get_kv_transfer_group()
    except Exception:  # noqa: BLE001
        pass
    sched = _scheduler(llm)
    if sched is not None:
        scheduler = sched.connector
    return worker, scheduler


def _scheduler(llm):
    """The engine's scheduler, in process (None in multiprocess mode: it is in another process)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler
    except Exception:  # noqa: BLE001
        return None


def lose_blocks_after_lookup(connector):
    """Fault injection: right after the kvstore scheduler connector's lookup found a request's
    blocks, delete them from the daemon, so the worker's load misses (as when the daemon loses
    blocks or dies between the two). Returns a function that undoes the patch."""
    side = connector.connector_scheduler
    original = side._matched_tokens

    def matched(request, num_computed_tokens):
        known = request.request_id in side._requests
        n = original(request, num_computed_tokens)
        if not known:
            hashes = side._requests[request.request_id].hashes
            side._lookup_link.call(lambda c, ns: c.delete(ns, hashes))
        return n

    side._matched_tokens = matched
    return lambda: setattr(side, "_matched_tokens", original)


def serve(llm, prompts: list, max_tokens: int, tag: str) -> dict:
    """Submit every prompt at once and step the engine, timing each request's tokens as they come
    out: TTFT from submission, inter-token gaps after that (a serving workload, offline)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    final: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - t0
            got = len(out.outputs[0].token_ids)
            stamps[out.request_id] += [now] * (got - len(stamps[out.request_id]))
            if out.finished:
                final[out.request_id] = out
    wall = time.perf_counter() - t0
    return {"outputs": [list(final[r].outputs[0].token_ids) for r in ids],
            "num_cached_tokens": [final[r].num_cached_tokens or 0 for r in ids],
            "ttft": [stamps[r][0] for r in ids],
            "itl": [[b - a for a, b in zip(stamps[r], stamps[r][1:])] for r in ids],
            "seconds": [wall]}


def _perturb_kv_caches(worker, seed: int) -> dict:
    """(Runs in the worker.) ``perturb_kv_ulp``'s work on this worker's KV cache tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seen, elements, dtypes = set(), 0, set()
    for t in worker.model_runner.kv_caches:
        storage = t.untyped_storage()   # the whole buffer (layers may be views into one)
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        dtypes.add(str(t.dtype))
        if t.dtype != torch.bfloat16:
            continue
        bits = torch.empty(0, dtype=torch.int16).set_(storage)
        for chunk in bits.split(1 << 22):
            mag = chunk & 0x7FFF
            step = torch.randint(0, 2, chunk.shape, generator=g, dtype=torch.int16).mul_(2).sub_(1)
            mag = torch.where(mag == 0, torch.ones_like(mag), mag + step)
            chunk.copy_((chunk & -0x8000) | mag)
            elements += chunk.numel()
    return {"elements": elements, "tensors": len(seen), "dtypes": sorted(dtypes)}


def perturb_kv_ulp(llm, seed: int) -> dict:
    """Move every element of the engine's KV cache one bf16 ulp: its magnitude one step up or down
    at random (a zero one step up, to the smallest subnormal), sign kept. Blocks in vLLM's prefix
    cache then hold KV that differs from what the engine computed by the least a bf16 cache can
    carry: how far the answers move for that measures the engine's own sensitivity, beside a
    codec's. Only bf16 caches are touched (``dtypes`` says what there was)."""
    (out,) = llm.collective_rpc(_perturb_kv_caches, args=(seed,))
    return out


def first_logprobs_to_file(llm, step: dict) -> dict:
    """The first generated token's log-probabilities over the whole vocabulary, for every prompt,
    written to ``step["logprobs_npy"]`` as float32 ``[prompts, vocab]``. Prompts go in batches of
    ``step["batch"]`` (16) and nothing is detokenized: a full-vocabulary answer is ``vocab`` Python
    objects per prompt, which for a real vocabulary (49,152) and hundreds of prompts at once would
    take gigabytes."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=-1, detokenize=False)
    prompts, batch = step["generate"], step.get("batch", 16)
    dense = np.full((len(prompts), step["vocab"]), -np.inf, dtype=np.float32)
    outputs, cached = [], []
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[start:start + batch]], params,
                            use_tqdm=False)
        for i, o in enumerate(outs, start):
            first = o.outputs[0].logprobs[0]
            dense[i, list(first)] = [lp.logprob for lp in first.values()]
            outputs.append(list(o.outputs[0].token_ids))
            cached.append(o.num_cached_tokens or 0)
    np.save(step["logprobs_npy"], dense)
    return {"outputs": outputs, "num_cached_tokens": cached, "seconds": [time.perf_counter() - t]}


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    sys.path.extend(job.get("extra_sys_path", []))
    if job.get("build"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tiny_model import build

        build(**job["build"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = dict(dtype="bfloat16", block_size=32, enforce_eager=True, seed=0, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=64 * 2**20, max_model_len=1024, enable_prefix_caching=False)
    kwargs.update(job.get("engine", {}))
    if job.get("metrics"):
        kwargs["disable_log_stats"] = False   # vLLM's Prometheus stat logger, with connector series
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"engine_start_seconds": time.perf_counter() - t0, "steps": []}
    worker, scheduler = _connectors(llm)

    for step in job["steps"]:
        out: dict = {}
        if "generate" in step and step.get("logprobs_npy"):
            out = first_logprobs_to_file(llm, step)
        elif "generate" in step:
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                    logprobs=step.get("logprobs"))
            prompts = [{"prompt": p} if isinstance(p, str) else TokensPrompt(prompt_token_ids=p)
                       for p in step["generate"]]
            undo = lose_blocks_after_lookup(scheduler) if step.get("lose_after_lookup") else None
            if step.get("timed"):
                outs, secs = [], []
                for p in prompts:
                    t = time.perf_counter()
                    outs += llm.generate([p], params, use_tqdm=False)
                    secs.append(time.perf_counter() - t)
            else:
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                secs = [time.perf_counter() - t]
            if undo is not None:
                undo()
            out = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                   "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs], "seconds": secs}
            if not kwargs["skip_tokenizer_init"]:
                out["texts"] = [o.outputs[0].text for o in outs]
                out["prompt_tokens"] = [len(o.prompt_token_ids) for o in outs]
            if step.get("logprobs") is not None:
                out["first_logprobs"] = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
        elif "serve" in step:
            out = serve(llm, step["serve"], step.get("max_tokens", 16), f"serve{len(result['steps'])}")
        elif "perturb_kv_ulp" in step:
            out = {"perturbed": perturb_kv_ulp(llm, int(step["perturb_kv_ulp"]))}
        elif "drain" in step:
            if worker is not None and hasattr(worker, "drain_saves"):
                worker.drain_saves()
        elif "kill" in step:
            from kvstore.ops.local_daemon import kill_until_released   # here: nothing before the job's env
            kill_until_released(int(step["kill"]))
        elif "sleep" in step:
            time.sleep(float(step["sleep"]))
        result["steps"].append(out)

    conn: dict = {}
    if worker is not None and hasattr(worker, "drain_saves"):
        worker.drain_saves()
        ns = getattr(worker, "namespace", None)
        if ns is not None:
            conn["namespace"] = ns.to_dict()
            conn["namespace_id"] = ns.id.hex()
        conn["worker"] = dict(getattr(worker, "totals", {}))
    if scheduler is not None and hasattr(scheduler, "totals"):
        conn["scheduler"] = dict(scheduler.totals)
    result["connector"] = conn
    sched = _scheduler(llm)
    if sched is not None:
        result["scheduler"] = {"class": type(sched).__name__, "policy": str(sched.policy.value)}
    if job.get("metrics"):
        result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "kvstore" in m.name}
    with open(result_path, "w") as f:
        json.dump(result, f)
    # Stop the engine core process (multiprocess mode), then skip interpreter teardown of engine
    # threads: the result is written.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

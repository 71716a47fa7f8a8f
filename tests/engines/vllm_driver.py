"""Drive one in-process vLLM engine through a scripted job (run inside the vLLM venv).

    python vllm_driver.py JOB.json RESULT.json

JOB: {"build": {"out_dir": DIR, "layers": 2, ...} (optional: tiny_model.build() first),
      "engine": {LLM kwargs: model, block_size, max_model_len, kv_cache_memory_bytes,
                 enable_prefix_caching, ...},
      "kv_transfer_config": {...} | null,
      "steps": [{"generate": [[token ids], ...], "max_tokens": 8, "timed": false},
                {"drain": true},            # wait until the kvstore connector's saves reached the daemon
                {"kill": PID},              # SIGKILL a process (the daemon) between steps
                {"sleep": SECONDS}]}
RESULT: {"steps": [{"outputs": [[ids]], "num_cached_tokens": [n], "seconds": [s]}, ...],
         "connector": {"namespace": {...}, "namespace_id": hex, "worker": {totals}, "scheduler": {totals}}}

Greedy sampling (temperature 0, ignore_eos) so outputs are a deterministic function of the KV.
With ``"timed": true`` prompts run one at a time and ``seconds`` is each one's wall time; with
``max_tokens`` 1 that is the time to first token.
"""

from __future__ import annotations

import json
import os
import signal
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
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except Exception:  # noqa: BLE001
        pass
    return worker, scheduler


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
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
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"engine_start_seconds": time.perf_counter() - t0, "steps": []}
    worker, scheduler = _connectors(llm)

    for step in job["steps"]:
        out: dict = {}
        if "generate" in step:
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in step["generate"]]
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
            out = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                   "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs], "seconds": secs}
        elif "drain" in step:
            if worker is not None and hasattr(worker, "drain_saves"):
                worker.drain_saves()
        elif "kill" in step:
            os.kill(int(step["kill"]), signal.SIGKILL)
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
    with open(result_path, "w") as f:
        json.dump(result, f)
    # Skip interpreter teardown of engine threads; the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

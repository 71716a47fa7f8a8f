"""Why a cached serving run's text can differ from the no-connector run's: the differing chat
requests of ``vllm_serve.md`` (0.25 req/s) computed offline in every way a serving run can
compute them, with vLLM's own prefix cache and no connector.

    .venv/bin/python benchmarks/bench_output_diffs.py        # ~10 min on 2 cores

It builds the chat rows of vllm_serve's first rate (benchmarks/chat_dataset.py, documents 0 and 1,
4 turns), runs benchmarks/output_diffs_driver.py in the vLLM venv (one OpenMP thread on core 0,
as the serving runs had), and names, for each text the driver got, the serving configurations
that produced it in each serving run given (``--serve``: vllm_serve.json and a rerun of its first
rate). Results: results/output_diffs.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

from bench_vllm_serve import BLOCK, MODEL_BUILDER, SERVER_ENV
from bench_vllm_ttft import ENGINE_VENV_BUILDER, HERE

from kvstore.ops.engines import engine_env, engine_venv, real_model_dir, run_engine_jobs
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report

DRIVER = os.path.join(HERE, "output_diffs_driver.py")
RESULTS = os.path.join(HERE, "results")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="5,6", help="chat requests to examine (indices in the rate's order)")
    ap.add_argument("--serve", default="vllm_serve.json,vllm_serve_rerun_025.json",
                    help="serving results (under results/) whose 0.25 req/s chat texts are compared")
    ap.add_argument("--out", default=os.path.join(RESULTS, "output_diffs"))
    a = ap.parse_args()
    python = os.path.join(engine_venv("vllm", ENGINE_VENV_BUILDER), "bin", "python")
    model = real_model_dir(MODEL_BUILDER)
    work = tempfile.mkdtemp(prefix="bench-output-diffs-")
    rows_path = os.path.join(work, "chat-0.json")
    subprocess.run([python, os.path.join(HERE, "chat_dataset.py"), model, rows_path, "--documents", "0,1",
                    "--turns", "4"], check=True, env={**engine_env(), "HF_HUB_OFFLINE": "1"})
    with open(rows_path) as f:
        rows = json.load(f)
    requests = [int(x) for x in a.requests.split(",")]
    earlier = [earlier_turn(rows, i) for i in requests]
    t0 = time.time()
    (found,) = run_engine_jobs(python, DRIVER, work, [("diffs", {"model": model, "block": BLOCK, "rows": rows,
                                                                   "requests": requests, "earlier": earlier})],
                               timeout_s=3000, env={**engine_env(), **SERVER_ENV})
    serve = {}
    for name in a.serve.split(","):
        with open(os.path.join(RESULTS, name)) as f:
            runs = json.load(f)["runs"]
        serve[name] = {c: r["chat"][0]["texts"] for c, r in runs.items() if r.get("chat")}
    write_report(a.out, {"benchmark": "output_diffs", "model": model, "block": BLOCK,
                         "requests": [{"index": i, "conversation": rows[i]["conversation"], "turn": rows[i]["turn"]}
                                      for i in requests],
                         "driver": found, "serving_texts": serve, "duration_s": round(time.time() - t0),
                         "machine": machine_facts()}, render_markdown)


def earlier_turn(rows: list[dict], i: int) -> int:
    """The request that holds the previous turn of request ``i``'s conversation."""
    return next(j for j in range(i - 1, -1, -1) if rows[j]["conversation"] == rows[i]["conversation"])


def render_markdown(r: dict) -> str:
    out = ["# Why a cached serving run's text can differ from the no-connector run's",
           "",
           "`benchmarks/bench_output_diffs.py`: the chat requests of `vllm_serve.md` at 0.25 req/s whose text "
           "differed in some configuration, computed offline by vLLM alone (its own prefix cache, no connector, one "
           "OpenMP thread, greedy, 16 tokens). For each text found, the serving configurations that produced the "
           "same text in each serving run (`vllm_serve.json`: the committed run; `vllm_serve_rerun_025.json`: its "
           "first rate run again).",
           "",
           machine_line(r["machine"]) + f"; {r['duration_s']} s.",
           ""]
    for req in r["requests"]:
        i = str(req["index"])
        d = r["driver"][i]
        label = {}

        def name(text: str) -> str:
            if text not in label:
                label[text] = chr(ord("A") + len(label))
            return label[text]

        cached = sorted({(name(c["text"])) for c in d["cached"]})
        out += [f"## Request {i} ({req['conversation']}, turn {req['turn']}, {d['prompt_tokens']} prompt tokens)", ""]
        ns = [c["cached_tokens"] for c in d["cached"]]
        out.append(f"- alone, with vLLM's prefix cache holding N tokens, N = {ns[0]}..{ns[-1]} in steps of "
                   f"{r['block']}: text {' / '.join(cached)} "
                   + ("(the same for every N)" if len(cached) == 1 else
                      "(" + ", ".join(f"N={c['cached_tokens']}: {name(c['text'])}" for c in d["cached"]) + ")"))
        alone = d["batched"][0]
        out.append(f"- a full prefill alone: {name(alone['text'])}; batched with another request's prefill: "
                   + ", ".join(f"with {b['with']}: {name(b['text'])}" for b in d["batched"][1:]))
        out.append(f"- reusing the prefix that its earlier turn (request {d['earlier']}) computed alone: "
                   f"{name(d['history'][0]['text'])} ({d['history'][0]['cached_tokens']} tokens cached); computed "
                   "batched with another request: "
                   + ", ".join(f"with {h['earlier_batched_with']}: {name(h['text'])}" for h in d["history"][1:]))
        for run, texts in r["serving_texts"].items():
            for text in [t[int(i)] for t in texts.values()]:
                name(text)
            out.append(f"- `{run}`: " + ", ".join(f"{c} {name(t[int(i)])}" for c, t in texts.items()))
        out += ["", "| text | |", "|---|---|"] + [f"| {v} | {json.dumps(k)} |" for k, v in label.items()] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    run_or_render(main, render_markdown)

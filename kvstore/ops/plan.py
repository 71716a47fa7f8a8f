"""``kvstore plan``: how much RAM and NVMe a node needs, by replaying a workload through the real store.

Each candidate (policy x codec x CPU size x NVMe size) is replayed through the production Store
over metadata-only tiers (kvstore.ops.plan_replay), priced with a stated TTFT model whose tier
bandwidths are measured on this host unless given (kvstore.ops.plan_cost), and reported as JSON,
markdown and curves (kvstore.ops.plan_report). This module is the command: model presets,
arguments, and ``run``/``main``; it re-exports the names callers use (``plan.replay``,
``plan.Candidate``, ``plan.recommend``, ``plan.CODECS``). Sizes follow kvstore.units: ``16GiB`` is
16 x 2^30 bytes, ``16GB`` is 16 x 10^9. Prefill speed must be given for the serving GPU (presets
carry a stated guess).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

from kvstore.errors import InvalidArgument
from kvstore.keys import DTYPE_SIZES, KVLayout
from kvstore.ops import workload as workloads
from kvstore.ops.machine import machine_facts
from kvstore.ops.plan_cost import (CODECS, DEFAULT_BANDWIDTH_GBPS, Codec, CostModel, measure_bandwidth,
                                   parse_bandwidth, recommend)
from kvstore.ops.plan_replay import (Candidate, codec_unavailable, ReplayResult, TraceClock, ideal_hit_rate, parse_policy, replay,
                                     sweep)
from kvstore.ops.plan_report import gib, plot, render_table, write_markdown
from kvstore.progress import Progress
from kvstore.store import StoreConfig
from kvstore.units import parse_size, parse_sizes

__all__ = ["CODECS", "Candidate", "Codec", "CostModel", "MODEL_PRESETS", "ReplayResult", "TraceClock",
           "build_parser", "ideal_hit_rate", "load_model", "main", "recommend", "replay", "run", "sweep"]

#: layers, kv heads, head dim, dtype, and a *guessed* prefill speed (tokens/s on one H100-class GPU)
MODEL_PRESETS: dict[str, dict] = {
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=12_000),
    "llama3-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=1_500),
    "qwen2.5-7b": dict(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16", prefill_tok_s=13_000),
    "mistral-7b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=12_000),
}


def load_model(spec: str, block_tokens: int, dtype: str | None = None) -> tuple[KVLayout, float | None]:
    """A preset name or a HuggingFace config.json -> (layout, preset prefill tokens/s or None)."""
    if spec in MODEL_PRESETS:
        p = dict(MODEL_PRESETS[spec])
        prefill = p.pop("prefill_tok_s")
        if dtype:
            p["dtype"] = dtype
        return KVLayout(model=spec, block_tokens=block_tokens, **p), prefill
    if not os.path.exists(spec):
        raise InvalidArgument("model", f"{spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
                                       "nor a config.json path")
    with open(spec) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as e:
        raise InvalidArgument(f"model.{e.args[0]}", f"{spec} has no {e.args[0]}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dt = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dt not in DTYPE_SIZES:
        raise InvalidArgument("model.torch_dtype", f"{dt!r}; one of {sorted(DTYPE_SIZES)} (or pass --dtype)")
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(spec))) or "model"
    return KVLayout(model=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                    block_tokens=block_tokens), None


# -- the command -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}) or a config.json path")
    p.add_argument("--dtype", help="KV dtype override (default: the model's)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--workload", required=True, action="append",
                   help="a JSONL trace path, or a generator spec: " + ", ".join(workloads.GENERATORS)
                   + " (e.g. chat:turns=8,rate=20); repeat to compare candidates across workloads")
    p.add_argument("--requests", type=int, help="replay the first N requests (generators: generate N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", default="8GiB,16GiB,32GiB",
                   help="candidate CPU tier sizes, comma-separated (GiB = 2^30 bytes, GB = 10^9)")
    p.add_argument("--nvme", default="0", help="candidate NVMe tier sizes, comma-separated (0: none)")
    p.add_argument("--codec", default="raw", help=f"codecs to try, comma-separated ({', '.join(CODECS)})")
    p.add_argument("--codec-table", help="JSON {codec: {ratio, decode_gbps}} overriding the built-in table")
    p.add_argument("--policy", default="prefix",
                   help="eviction policies to try, comma-separated (prefix, lru, s3fifo); one candidate may "
                        "set each tier's, as cpu=s3fifo+nvme=lru (a tier not named: prefix)")
    p.add_argument("--write-through", action="store_true", help="put also writes the NVMe tier")
    p.add_argument("--no-promote", action="store_true", help="do not copy NVMe hits up to the CPU tier")
    p.add_argument("--lease-seconds", type=float, default=StoreConfig.lease_seconds,
                   help="how long a lookup pins what it reports (trace time)")
    p.add_argument("--cpu-slot-bytes", default="256KiB", help="CPU arena slot size (as the daemon's)")
    p.add_argument("--prefill-tok-s", type=float, help="prefill speed of the serving GPU, tokens/s")
    p.add_argument("--bandwidth", help="tier read bandwidth, e.g. cpu=19,nvme=3 (GB/s); default: measure here")
    p.add_argument("--measure-dir", default=tempfile.gettempdir(), help="directory for the NVMe read measurement")
    p.add_argument("--rpc-ms", type=float, default=0.5, help="fixed per-request lookup overhead (ms)")
    p.add_argument("--target-hit-rate", type=float, help="recommend the cheapest candidate reaching this hit rate")
    p.add_argument("--target-ttft-ms", type=float, help="recommend the cheapest candidate reaching this TTFT")
    p.add_argument("--ttft-percentile", type=int, default=90, choices=(50, 90, 99))
    p.add_argument("--price-cpu-gib", type=float, default=1.0, help="relative price of 1 GiB RAM")
    p.add_argument("--price-nvme-gib", type=float, default=0.05, help="relative price of 1 GiB NVMe")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel replays")
    p.add_argument("--out", default="plan", help="output prefix: writes PREFIX.json, PREFIX.md and PREFIX.png")
    p.add_argument("--quiet", action="store_true", help="no table, no progress")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    return p


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in known:
            raise InvalidArgument(what, f"unknown {what} {name!r}; one of {sorted(known)}")
    return names


def _replay_workload(spec: str, args: argparse.Namespace, layout: KVLayout, candidates: list[Candidate],
                     cost: CostModel, config: StoreConfig, slot_bytes: int, say) -> tuple[dict, list[dict]]:
    """Load one workload and replay every candidate on it: (its summary, one result per candidate)."""
    t0 = time.perf_counter()
    try:
        requests = workloads.load(spec, args.block_tokens, args.requests, args.seed)
    except OSError as e:
        raise InvalidArgument("workload", f"cannot read {spec}: {e.strerror or e}") from None
    load_s = time.perf_counter() - t0
    if not requests:
        raise InvalidArgument("workload", f"{spec}: no requests")
    ideal = ideal_hit_rate(requests)
    say(f"[bold]{spec}[/]: {len(requests):,} requests ({sum(r.num_blocks for r in requests):,} blocks of "
        f"{layout.block_bytes / 2**20:.2f} MiB raw) loaded in {load_s:.1f}s; infinite-cache hit rate "
        f"{ideal:.1%}; {len(candidates)} candidate(s) on {max(1, min(args.jobs, len(candidates)))} process(es)")

    def progress(r: dict) -> None:
        say(f"  {r['policy']:6} {r['codec']:4} cpu {gib(r['cpu_bytes']):>7} nvme {gib(r['nvme_bytes']):>7}: "
            f"hit {r['hit_rate']:.1%}, TTFT p90 {r['ttft_ms']['p90']:.0f} ms ({r['replay_seconds']:.0f}s)")

    t1 = time.perf_counter()
    # the requests replayed over all candidates, on stderr (--json too): a bar on a terminal, else a line
    # every few seconds
    with Progress("kvstore plan", total=len(requests) * len(candidates), unit="requests",
                  quiet=args.quiet) as replaying:
        results = sweep(requests, layout, candidates, cost, config, slot_bytes, args.jobs, progress,
                        lambda n: replaying.update(n, label=spec.partition(":")[0]))   # chat, not its parameters
    for r in results:
        r.pop("ttft_ms_samples", None)
        r["workload"] = spec
    rec = None
    if args.target_hit_rate is not None or args.target_ttft_ms is not None:
        rec = recommend(results, args.target_hit_rate, args.target_ttft_ms, args.ttft_percentile,
                        args.price_cpu_gib, args.price_nvme_gib)
    summary = {"workload": spec, "requests": len(requests), "blocks": sum(r.num_blocks for r in requests),
               "infinite_cache_hit_rate": ideal, "recommendation": rec,
               "load_seconds": round(load_s, 2), "sweep_seconds": round(time.perf_counter() - t1, 2)}
    return summary, results


def run(args: argparse.Namespace, console=None) -> dict:
    from rich.console import Console
    console = console or Console(stderr=False)
    quiet = args.quiet or args.json

    def say(text: str) -> None:
        if not quiet:
            console.print(text)

    if args.codec_table:
        try:
            with open(args.codec_table) as f:
                for name, d in json.load(f).items():
                    CODECS[name] = Codec(float(d["ratio"]), float(d.get("decode_gbps", math.inf)))
        except OSError as e:
            raise InvalidArgument("codec_table", f"cannot read {args.codec_table}: {e.strerror or e}") from None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise InvalidArgument("codec_table", f"{args.codec_table} is not {{codec: {{ratio, decode_gbps}}}}: "
                                                 f"{type(e).__name__}: {e}") from None
    codecs = _names(args.codec, CODECS, "codec")
    for codec in codecs:   # a codec the planner encodes for real must run in this install
        reason = codec_unavailable(codec)
        if reason:
            raise InvalidArgument("codec", reason)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for policy in policies:
        parse_policy(policy)   # refuses an unknown policy or tier before any replay
    if args.block_tokens < 1:
        raise InvalidArgument("block_tokens", "must be >= 1")
    layout, preset_prefill = load_model(args.model, args.block_tokens, args.dtype)
    prefill = args.prefill_tok_s or preset_prefill
    if not prefill:
        raise InvalidArgument("prefill_tok_s", "give --prefill-tok-s for a model that is not a preset")
    cpu_sizes, nvme_sizes = parse_sizes(args.cpu, "cpu"), parse_sizes(args.nvme, "nvme")
    slot_bytes = parse_size(args.cpu_slot_bytes, "cpu_slot_bytes")
    if args.bandwidth:
        bandwidth = {**DEFAULT_BANDWIDTH_GBPS, **parse_bandwidth(args.bandwidth)}
        bw_source = "given"
    else:
        with Progress("kvstore plan", total=1, quiet=args.quiet) as step:   # seconds: say what it does
            step.advance(f"measuring this host's tier read bandwidths in {args.measure_dir} (--bandwidth skips this)")
            bandwidth = measure_bandwidth(layout.block_bytes, args.measure_dir)
        bw_source = "measured on this host (kvstore.ops.ceilings)"
    cost = CostModel(bandwidth, prefill, args.rpc_ms)
    config = StoreConfig(write_through=args.write_through, promote_on_hit=not args.no_promote,
                         lease_seconds=args.lease_seconds)
    candidates = [Candidate(pol, codec, c, n) for pol in policies for codec in codecs
                  for n in nvme_sizes for c in cpu_sizes if c or n]

    if isinstance(args.workload, str):   # a Namespace built by hand, not by build_parser
        args.workload = [args.workload]
    summaries, results = [], []
    for spec in args.workload:
        summary, replayed = _replay_workload(spec, args, layout, candidates, cost, config, slot_bytes, say)
        summaries.append(summary)
        results += replayed
    report = {
        "command": "kvstore plan " + " ".join(getattr(args, "argv", None) or []),
        "model": layout.to_dict(), "workloads": summaries,
        "cost_model": {"bandwidth_gbps": bandwidth, "bandwidth_source": bw_source, "prefill_tok_s": prefill,
                       "prefill_source": "given" if args.prefill_tok_s else "preset guess", "rpc_ms": args.rpc_ms,
                       "formula": "rpc_ms + sum_t(bytes_t / bw_t) + codec decode + recomputed_tokens / prefill"},
        "codecs": {c: dataclasses.asdict(CODECS[c]) for c in codecs},
        "store_config": dataclasses.asdict(config) | {"cpu_slot_bytes": slot_bytes},
        "timing": {"load_seconds": round(sum(w["load_seconds"] for w in summaries), 2),
                   "sweep_seconds": round(sum(w["sweep_seconds"] for w in summaries), 2), "jobs": args.jobs},
        "targets": {"hit_rate": args.target_hit_rate, "ttft_ms": args.target_ttft_ms,
                    "percentile": args.ttft_percentile},
        "recommendation": summaries[0]["recommendation"] if len(summaries) == 1 else None,
        "results": results, "machine": machine_facts(tempfile.gettempdir()),
    }
    if len(summaries) == 1:   # one workload: its figures also at the top level, where single-workload readers look
        report.update({k: summaries[0][k] for k in ("workload", "requests", "blocks", "infinite_cache_hit_rate")})
    report["cost_model"]["bandwidth_gbps"] = {k: (v if math.isfinite(v) else None) for k, v in bandwidth.items()}
    for c in report["codecs"].values():
        c["decode_gbps"] = c["decode_gbps"] if math.isfinite(c["decode_gbps"]) else None
    with Progress("kvstore plan", total=1, quiet=args.quiet) as step:
        step.advance(f"writing {args.out}.json, {args.out}.md and {args.out}.png")
        _write_outputs(report, args, layout)
    if args.json:
        print(json.dumps(report, indent=1))
    elif not args.quiet:
        render_table(results, console)
        for w in summaries:
            _say_recommendation(w, args, console)
        console.print(f"wrote {args.out}.json, {args.out}.md and {args.out}.png")
    return report


def _write_outputs(report: dict, args: argparse.Namespace, layout: KVLayout) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, args.out + ".md")
    specs = ", ".join(w["workload"] for w in report["workloads"])
    requests = sum(w["requests"] for w in report["workloads"])
    plot(report["results"], args.out + ".png", f"{layout.model}, {specs}, {requests:,} requests, "
                                               f"block {args.block_tokens} tokens",
         percentile=args.ttft_percentile, target_ttft_ms=args.target_ttft_ms, target_hit_rate=args.target_hit_rate,
         recommendation=report["recommendation"])


def _say_recommendation(summary: dict, args: argparse.Namespace, console) -> None:
    rec = summary["recommendation"]
    where = f"{summary['workload']}: " if len(args.workload) > 1 else ""
    if rec:
        p = f"p{args.ttft_percentile}"
        console.print(f"[bold green]recommended[/] {where}cpu {gib(rec['cpu_bytes'])}, nvme {gib(rec['nvme_bytes'])}, "
                      f"codec {rec['codec']}, policy {rec['policy']}: hit {rec['hit_rate']:.1%}, TTFT "
                      f"{p} {rec['ttft_ms'][p]:.0f} ms")
    elif args.target_hit_rate is not None or args.target_ttft_ms is not None:
        console.print(f"[bold red]no candidate reaches the target[/] {where}try larger sizes or another codec")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except InvalidArgument as e:
        print(f"kvstore plan: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

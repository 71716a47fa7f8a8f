"""``kvstore plan``: how much RAM and NVMe a node needs, by replaying a workload through the real store.

The replay builds the production ``Store`` with the production eviction policies over
``MetadataTier``s (sizes, no bytes) and, per request, does what a connector does: ``lookup`` the
longest cached prefix, ``get`` the hits, ``put`` the misses. Every eviction, demotion, promotion
and lease decision is therefore the real one; only the payload copies are skipped. Each
candidate (policy x codec x CPU size x NVMe size) is one replay; candidates run in parallel.

Leases are real too: the replay runs the store on the trace's clock (``TraceClock``), so a block
looked up at t is pinned until t + lease_seconds of *trace* time, whatever the replay speed.

TTFT per request is a model, stated in the JSON: ``rpc_ms`` + for each hit tier
``bytes / bandwidth`` (+ codec decode) + ``recomputed tokens / prefill_tok_s``. Bandwidths are
measured on this host (``benchmarks/ceilings.py``) unless given; prefill speed must be given for
the serving GPU (presets carry a stated guess).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvstore import store as store_module
from kvstore.ops import workload as workloads
from kvstore.errors import InvalidArgument, StoreFull
from kvstore.keys import DTYPE_SIZES, KVLayout, Namespace
from kvstore.store.policy import POLICIES
from kvstore.store import Store, StoreConfig
from kvstore.tiers.metadata import MetadataTier

GiB = 1 << 30

#: layers, kv heads, head dim, dtype, and a *guessed* prefill speed (tokens/s on one H100-class GPU)
MODEL_PRESETS: dict[str, dict] = {
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=12_000),
    "llama3-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=1_500),
    "qwen2.5-7b": dict(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16", prefill_tok_s=13_000),
    "mistral-7b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", prefill_tok_s=12_000),
}


@dataclasses.dataclass(frozen=True)
class Codec:
    ratio: float          # raw bytes / stored bytes
    decode_gbps: float    # GB/s of raw output when decoding on load (inf: nothing to decode)


#: Compression ratios and decode speeds. Update as the codec benchmarks land (or pass --codec-table).
#: fp8/int4 decode speeds are the CPU figures measured here (notes/peers-and-ceilings.md).
CODECS: dict[str, Codec] = {
    "raw": Codec(1.0, math.inf),
    "fp8": Codec(1.97, 1.1),
    "int4": Codec(3.6, 3.7),
}

#: used only with --no-measure: figures measured on the development host (peers-and-ceilings.md)
DEFAULT_BANDWIDTH_GBPS = {"cpu": 19.0, "nvme": 3.05}


# -- the trace clock -------------------------------------------------------------------------------

class TraceClock:
    """The replay's clock: leases expire in trace time, not wall time (given to the Store)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- one replay ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Candidate:
    policy: str
    codec: str
    cpu_bytes: int
    nvme_bytes: int


@dataclasses.dataclass
class ReplayResult:
    candidate: Candidate
    requests: int
    blocks: int                       # full blocks asked for
    hit_blocks: dict[str, int]        # per tier
    miss_blocks: int
    put_rejected: int
    counters: dict[str, int]
    bytes_loaded: dict[str, int]      # per tier, stored bytes read on hits
    bytes_written: int                # stored bytes put
    bytes_placed: dict[str, int]      # per tier, stored bytes of every copy placed (puts, demotions,
                                      # promotions, write-through): the write traffic each medium sees
    bytes_demoted: int
    bytes_promoted: int
    ttft_ms: np.ndarray | None = None
    hit_tiers: list[tuple[int, ...]] | None = None  # per request blocks hit per tier (checks)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_blocks.values()) / self.blocks if self.blocks else 0.0

    def tier_hit_rate(self, tier: str) -> float:
        return self.hit_blocks.get(tier, 0) / self.blocks if self.blocks else 0.0

    def ttft_percentile(self, p: float) -> float:
        return float(np.percentile(self.ttft_ms, p)) if self.ttft_ms is not None and len(self.ttft_ms) else 0.0

    def summary(self) -> dict:
        c = self.candidate
        return {
            "policy": c.policy, "codec": c.codec, "cpu_bytes": c.cpu_bytes, "nvme_bytes": c.nvme_bytes,
            "requests": self.requests, "blocks": self.blocks, "hit_rate": self.hit_rate,
            "hit_rate_per_tier": {t: self.tier_hit_rate(t) for t in self.hit_blocks},
            "hit_blocks": self.hit_blocks, "miss_blocks": self.miss_blocks, "put_rejected": self.put_rejected,
            "bytes_loaded": self.bytes_loaded, "bytes_written": self.bytes_written,
            "bytes_placed": self.bytes_placed,
            "bytes_demoted": self.bytes_demoted, "bytes_promoted": self.bytes_promoted,
            "ttft_ms": {f"p{p}": self.ttft_percentile(p) for p in (50, 90, 99)}
            | {"mean": float(self.ttft_ms.mean()) if self.ttft_ms is not None and len(self.ttft_ms) else 0.0},
            "counters": self.counters, "replay_seconds": round(self.seconds, 2),
        }


@dataclasses.dataclass(frozen=True)
class CostModel:
    """TTFT = rpc_ms + sum(bytes per tier / bandwidth) + decode + recomputed tokens / prefill."""

    bandwidth_gbps: dict[str, float]
    prefill_tok_s: float
    rpc_ms: float = 0.5


def metadata_tiers(c: Candidate, slot_bytes: int) -> list[MetadataTier]:
    tiers = []
    if c.cpu_bytes:
        tiers.append(MetadataTier.like_cpu(c.cpu_bytes, slot_bytes))
    if c.nvme_bytes:
        tiers.append(MetadataTier.like_nvme(c.nvme_bytes))
    if not tiers:
        raise InvalidArgument("tier sizes", "a candidate needs a CPU or an NVMe tier (both are 0)")
    return tiers


def stored_layout(layout: KVLayout, codec: str) -> KVLayout:
    """The layout whose block size is what the codec stores (the planner's model of a codec)."""
    ratio = CODECS[codec].ratio
    return dataclasses.replace(layout, block_bytes=max(1, math.ceil(layout.shape_bytes / ratio)))


def replay(requests: Iterable[workloads.Request], layout: KVLayout, candidate: Candidate,
           cost: CostModel | None = None, config: StoreConfig | None = None,
           tiers: Sequence | None = None, slot_bytes: int = 256 * 1024, keep_hit_tiers: bool = False,
           on_progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` through a real Store: lookup, get the hits, put the misses.

    ``tiers`` defaults to metadata tiers for ``candidate``; tests pass real tiers to check that
    both give the same answer.
    """
    config = dataclasses.replace(config or StoreConfig(), eviction_policy=candidate.policy)
    own_tiers = tiers is None
    tiers = list(tiers) if tiers is not None else metadata_tiers(candidate, slot_bytes)
    ns = Namespace(stored_layout(layout, candidate.codec), cache_salt="kvstore-plan")
    block_bytes = ns.block_bytes
    names = [t.name for t in tiers]
    hit_blocks = dict.fromkeys(names, 0)
    codec = CODECS[candidate.codec]
    ttfts: list[float] = []
    hit_tiers: list[tuple[int, ...]] = []
    blocks = misses = rejected = n_requests = 0
    started = time.perf_counter()
    clock = TraceClock()
    store = Store(tiers, config, clock=clock)
    try:
        ns_id = store.register_namespace(ns)
        payload = np.zeros(block_bytes, dtype=np.uint8)   # one buffer, reused for every put
        outs = [payload] * store_module.MAX_BATCH          # and as every get's destination
        for req in requests:
            clock.now = req.t
            hashes = req.hash_list()
            got = dict.fromkeys(names, 0)
            n_hit = 0
            for lo in range(0, len(hashes), store_module.MAX_BATCH):
                chunk = hashes[lo:lo + store_module.MAX_BATCH]
                n = store.lookup(ns_id, chunk).num_hit
                n_hit += _get_hits(store, ns_id, chunk[:n], outs, got)
                if n < len(chunk) or n_hit < lo + n:
                    break
            for lo in range(n_hit, len(hashes), store_module.MAX_BATCH):
                chunk = hashes[lo:lo + store_module.MAX_BATCH]
                try:
                    store.put(ns_id, chunk, [payload] * len(chunk), parent=hashes[lo - 1] if lo else None)
                except StoreFull:
                    rejected += 1
                    break
            for name in names:
                hit_blocks[name] += got[name]
            blocks += len(hashes)
            misses += len(hashes) - n_hit
            n_requests += 1
            if on_progress is not None and n_requests % 100_000 == 0:
                on_progress(n_requests)
            if keep_hit_tiers:
                hit_tiers.append(tuple(got[n] for n in names))
            if cost is not None:
                ttfts.append(_ttft_ms(cost, codec, block_bytes, layout, got, req.tokens - n_hit * layout.block_tokens))
        counters = dict(store.counters)
        placed = {t.name: getattr(t, "bytes_placed", None) for t in tiers}
    finally:
        store.close()
        if own_tiers:
            for t in tiers:
                t.close()
    return ReplayResult(
        candidate, n_requests, blocks, hit_blocks, misses, rejected, counters,
        bytes_loaded={n: hit_blocks[n] * block_bytes for n in names},
        bytes_written=counters.get("bytes_in", 0), bytes_placed=placed,
        bytes_demoted=counters.get("demotions", 0) * block_bytes,
        bytes_promoted=counters.get("promotions", 0) * block_bytes,
        ttft_ms=np.asarray(ttfts, dtype=np.float64) if cost is not None else None,
        hit_tiers=hit_tiers if keep_hit_tiers else None, seconds=time.perf_counter() - started)


def _get_hits(store: Store, ns_id: bytes, hashes: list[bytes], outs: list, got: dict[str, int]) -> int:
    """Get the looked-up blocks; count per tier (the store's own counters say where each came
    from). Returns the leading blocks actually read (a get may miss after a lookup hit)."""
    if not hashes:
        return 0
    before = {name: store.counters.get(f"hits_{name}", 0) for name in got}
    sizes = store.get_into(ns_id, hashes, outs[:len(hashes)])
    for name in got:
        got[name] += store.counters.get(f"hits_{name}", 0) - before[name]
    n = 0
    while n < len(sizes) and sizes[n] is not None:
        n += 1
    return n


def _ttft_ms(cost: CostModel, codec: Codec, block_bytes: int, layout: KVLayout, got: dict[str, int],
             recompute_tokens: int) -> float:
    ms = cost.rpc_ms
    raw_loaded = 0
    for name, n in got.items():
        if n:
            ms += n * block_bytes / (cost.bandwidth_gbps[name] * 1e9) * 1e3
            raw_loaded += n * layout.shape_bytes
    if raw_loaded and math.isfinite(codec.decode_gbps):
        ms += raw_loaded / (codec.decode_gbps * 1e9) * 1e3
    return ms + max(0, recompute_tokens) / cost.prefill_tok_s * 1e3


# -- the sweep -------------------------------------------------------------------------------------

_SHARED: dict = {}


def _replay_shared(candidate: Candidate) -> dict:
    s = _SHARED
    result = replay(s["requests"], s["layout"], candidate, s["cost"], s["config"], slot_bytes=s["slot_bytes"],
                    on_progress=s.get("on_progress"))
    out = result.summary()
    out["ttft_ms_samples"] = None
    return out


def sweep(requests: list[workloads.Request], layout: KVLayout, candidates: list[Candidate], cost: CostModel,
          config: StoreConfig, slot_bytes: int, jobs: int, progress: Callable[[dict], None] | None = None,
          on_requests: Callable[[int], None] | None = None) -> list[dict]:
    """Replay every candidate (in ``jobs`` forked processes sharing the request list).
    ``on_requests`` hears every 100,000 requests replayed, in the serial case only."""
    serial = jobs <= 1 or len(candidates) == 1
    _SHARED.update(requests=requests, layout=layout, cost=cost, config=config, slot_bytes=slot_bytes,
                   on_progress=on_requests if serial else None)
    results = []
    try:
        if serial:
            for c in candidates:
                results.append(_replay_shared(c))
                if progress:
                    progress(results[-1])
        else:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for r in pool.imap(_replay_shared, candidates):
                    results.append(r)
                    if progress:
                        progress(r)
    finally:
        _SHARED.clear()
    return results


def ideal_hit_rate(requests: list[workloads.Request]) -> float:
    """The hit rate of an infinite cache: the reuse the workload offers at all."""
    seen: set[bytes] = set()
    hits = total = 0
    for r in requests:
        for h in r.hash_list():
            total += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return hits / total if total else 0.0


def recommend(results: list[dict], target_hit_rate: float | None = None, target_ttft_ms: float | None = None,
              percentile: int = 90, price_cpu_gib: float = 1.0, price_nvme_gib: float = 0.05) -> dict | None:
    """The cheapest candidate meeting every target (cost = GiB x price; ties: less RAM first)."""
    def ok(r: dict) -> bool:
        if target_hit_rate is not None and r["hit_rate"] < target_hit_rate:
            return False
        if target_ttft_ms is not None and r["ttft_ms"][f"p{percentile}"] > target_ttft_ms:
            return False
        return True

    def price(r: dict) -> tuple:
        cost = r["cpu_bytes"] / GiB * price_cpu_gib + r["nvme_bytes"] / GiB * price_nvme_gib
        return (cost, r["cpu_bytes"], r["nvme_bytes"])

    passing = [r for r in results if ok(r)]
    if not passing:
        return None
    best = min(passing, key=price)  # first in input order among equals: policies/codecs as listed
    return {**{k: best[k] for k in ("policy", "codec", "cpu_bytes", "nvme_bytes", "hit_rate", "ttft_ms")},
            "cost": price(best)[0]}


# -- inputs ----------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, field: str) -> int:
    """``"16GiB"`` / ``"512MiB"`` / ``"0"`` -> bytes (binary units; ``GB`` is read as GiB too)."""
    m = _SIZE.match(text)
    if not m:
        raise InvalidArgument(field, f"{text!r} is not a size such as 16GiB or 512MiB")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def parse_sizes(text: str, field: str) -> list[int]:
    return sorted({parse_size(s, field) for s in text.split(",") if s.strip()})


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


def measure_bandwidth(block_bytes: int, directory: str) -> dict[str, float]:
    """Tier read bandwidth on this host, from benchmarks/ceilings.py (memcpy; O_DIRECT reads)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    try:
        from benchmarks import ceilings
    except ImportError:
        return dict(DEFAULT_BANDWIDTH_GBPS)
    finally:
        sys.path.remove(root)
    nbytes = max(block_bytes, 1 << 20)
    return {"cpu": ceilings.memcpy_gbps(nbytes, reps=3),
            "nvme": ceilings.odirect_read_gbps(directory, nbytes, reps=3, files=16)}


def parse_bandwidth(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        try:
            out[name.strip()] = float(value.lower().removesuffix("gb/s").removesuffix("gbps"))
        except ValueError:
            raise InvalidArgument("bandwidth", f"{item!r}: want tier=GB/s, e.g. cpu=19,nvme=3") from None
        if not eq or out[name.strip()] <= 0:
            raise InvalidArgument("bandwidth", f"{item!r}: want tier=GB/s > 0")
    return out


# -- output ----------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GiB:g} GiB" if n else "0"


def write_markdown(report: dict, path: str) -> None:
    """A short human summary of a plan run (what benchmarks/results/plan_*.md hold)."""
    cm = report["cost_model"]
    lines = [f"# kvstore plan: {report['model']['model']}, `{report['workload']}`", "",
             f"Command: `{report.get('command', 'kvstore plan')}`", "",
             f"{report['requests']:,} requests, {report['blocks']:,} blocks of {report['model']['block_tokens']} tokens "
             f"({report['model']['block_bytes'] / 2**20:.2f} MiB raw); infinite-cache hit rate "
             f"{report['infinite_cache_hit_rate']:.1%}. Store config: `{json.dumps(report['store_config'])}`.", "",
             f"TTFT model: {cm['formula']}; bandwidth GB/s {cm['bandwidth_gbps']} ({cm['bandwidth_source']}), "
             f"prefill {cm['prefill_tok_s']:,.0f} tok/s ({cm['prefill_source']}), rpc {cm['rpc_ms']} ms.", "",
             "| policy | codec | cpu | nvme | hit cpu | hit nvme | hit total | loaded GB | put GB | demoted GB "
             "| promoted GB | NVMe written GB | TTFT p50 ms | p90 | p99 | replay s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        per = r["hit_rate_per_tier"]
        lines.append(
            f"| {r['policy']} | {r['codec']} | {_gib(r['cpu_bytes'])} | {_gib(r['nvme_bytes'])} | "
            f"{per.get('cpu', 0):.1%} | {per.get('nvme', 0):.1%} | {r['hit_rate']:.1%} | "
            f"{sum(r['bytes_loaded'].values()) / 1e9:.1f} | {r['bytes_written'] / 1e9:.1f} | "
            f"{r['bytes_demoted'] / 1e9:.1f} | {r['bytes_promoted'] / 1e9:.1f} | "
            f"{(r['bytes_placed'].get('nvme') or 0) / 1e9:.1f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['ttft_ms']['p90']:.0f} | {r['ttft_ms']['p99']:.0f} | {r['replay_seconds']:.0f} |")
    rec = report.get("recommendation")
    t = report.get("targets", {})
    if rec:
        lines += ["", f"Recommendation for target {t}: cpu {_gib(rec['cpu_bytes'])}, nvme {_gib(rec['nvme_bytes'])}, "
                      f"codec {rec['codec']}, policy {rec['policy']} (hit {rec['hit_rate']:.1%})."]
    facts = report.get("machine")
    if facts:
        lines += ["", f"Machine: `{json.dumps(facts)}`"]
    timing = report.get("timing", {})
    lines += ["", f"Timing: {timing}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def machine_facts() -> dict | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    try:
        from benchmarks import ceilings
        return ceilings.machine_facts(tempfile.gettempdir())
    except Exception:  # facts are a courtesy; a plan never fails for them
        return None
    finally:
        sys.path.remove(root)


def render_table(results: list[dict], console) -> None:
    from rich.table import Table
    table = Table(title="kvstore plan: replay per candidate", show_lines=False)
    for col in ("policy", "codec", "cpu", "nvme", "hit cpu", "hit nvme", "hit total", "loaded GB",
                "demoted GB", "TTFT p50 ms", "p90", "p99"):
        table.add_column(col, justify="right" if col not in ("policy", "codec") else "left")
    for r in results:
        per = r["hit_rate_per_tier"]
        table.add_row(r["policy"], r["codec"], _gib(r["cpu_bytes"]), _gib(r["nvme_bytes"]),
                      f"{per.get('cpu', 0):.1%}", f"{per.get('nvme', 0):.1%}", f"{r['hit_rate']:.1%}",
                      f"{sum(r['bytes_loaded'].values()) / 1e9:.1f}", f"{r['bytes_demoted'] / 1e9:.1f}",
                      f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p90']:.0f}", f"{r['ttft_ms']['p99']:.0f}")
    console.print(table)


def plot(results: list[dict], path: str, title: str) -> None:
    """Miss-ratio curves (hit rate vs CPU capacity, per NVMe size / codec / policy) and TTFT
    percentiles vs capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[tuple, list[dict]] = {}
    for r in results:
        series.setdefault((r["policy"], r["codec"], r["nvme_bytes"]), []).append(r)
    styles = {"prefix": "-", "lru": "--"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((policy, codec, nvme), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["cpu_bytes"])
        x = [r["cpu_bytes"] / GiB for r in rs]
        color = colors[i % len(colors)]
        label = f"{policy}, {codec}, nvme {_gib(nvme)}"
        ls = styles.get(policy, ":")
        ax_hit.plot(x, [r["hit_rate"] for r in rs], ls, marker="o", color=color, label=f"{label}: total")
        if nvme:
            ax_hit.plot(x, [r["hit_rate_per_tier"].get("cpu", 0) for r in rs], ls, marker=".", color=color,
                        alpha=0.45, label=f"{label}: from cpu")
        ax_ttft.plot(x, [r["ttft_ms"]["p50"] for r in rs], ls, marker="o", color=color, label=f"{label}: p50")
        ax_ttft.plot(x, [r["ttft_ms"]["p99"] for r in rs], ls, marker="^", color=color, alpha=0.6,
                     label=f"{label}: p99")
    ax_hit.set(xlabel="CPU tier capacity (GiB)", ylabel="block hit rate", title="hit rate vs capacity", ylim=(0, 1))
    ax_ttft.set(xlabel="CPU tier capacity (GiB)", ylabel="estimated TTFT (ms)", title="TTFT percentiles vs capacity")
    for ax in (ax_hit, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}) or a config.json path")
    p.add_argument("--dtype", help="KV dtype override (default: the model's)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--workload", required=True,
                   help="a JSONL trace path, or a generator spec: " + ", ".join(workloads.GENERATORS)
                   + " (e.g. chat:turns=8,rate=20)")
    p.add_argument("--requests", type=int, help="replay the first N requests (generators: generate N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", default="8GiB,16GiB,32GiB", help="candidate CPU tier sizes, comma-separated")
    p.add_argument("--nvme", default="0", help="candidate NVMe tier sizes, comma-separated (0: none)")
    p.add_argument("--codec", default="raw", help=f"codecs to try, comma-separated ({', '.join(CODECS)})")
    p.add_argument("--codec-table", help="JSON {codec: {ratio, decode_gbps}} overriding the built-in table")
    p.add_argument("--policy", default="prefix", help="eviction policies to try, comma-separated (prefix, lru)")
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
    return p


def run(args: argparse.Namespace, console=None) -> dict:
    from rich.console import Console
    console = console or Console(stderr=False)
    if args.codec_table:
        with open(args.codec_table) as f:
            for name, d in json.load(f).items():
                CODECS[name] = Codec(float(d["ratio"]), float(d.get("decode_gbps", math.inf)))
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS:
            raise InvalidArgument("codec", f"unknown codec {c!r}; one of {sorted(CODECS)}")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for pol in policies:
        if pol not in POLICIES:
            raise InvalidArgument("policy", f"unknown policy {pol!r}; one of {sorted(POLICIES)}")
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
        bandwidth = measure_bandwidth(layout.block_bytes, args.measure_dir)
        bw_source = "measured on this host (benchmarks/ceilings.py)"
    cost = CostModel(bandwidth, prefill, args.rpc_ms)
    config = StoreConfig(write_through=args.write_through, promote_on_hit=not args.no_promote,
                         lease_seconds=args.lease_seconds)

    t0 = time.perf_counter()
    requests = workloads.load(args.workload, args.block_tokens, args.requests, args.seed)
    load_s = time.perf_counter() - t0
    if not requests:
        raise InvalidArgument("workload", "no requests")
    ideal = ideal_hit_rate(requests)
    candidates = [Candidate(pol, codec, c, n) for pol in policies for codec in codecs
                  for n in nvme_sizes for c in cpu_sizes if c or n]
    if not args.quiet:
        console.print(f"[bold]{len(requests):,}[/] requests ({sum(r.num_blocks for r in requests):,} blocks of "
                      f"{layout.block_bytes / 2**20:.2f} MiB raw) loaded in {load_s:.1f}s; infinite-cache hit "
                      f"rate {ideal:.1%}; {len(candidates)} candidate(s) on "
                      f"{max(1, min(args.jobs, len(candidates)))} process(es)")

    def progress(r: dict) -> None:
        if not args.quiet:
            console.print(f"  {r['policy']:6} {r['codec']:4} cpu {_gib(r['cpu_bytes']):>9} nvme "
                          f"{_gib(r['nvme_bytes']):>9}: hit {r['hit_rate']:.1%}, TTFT p90 "
                          f"{r['ttft_ms']['p90']:.0f} ms ({r['replay_seconds']:.0f}s)")

    t1 = time.perf_counter()
    def replayed(n: int) -> None:
        if not args.quiet:
            console.print(f"  ... {n:,} of {len(requests):,} requests replayed ({time.perf_counter() - t1:.0f}s)")

    results = sweep(requests, layout, candidates, cost, config, slot_bytes, args.jobs, progress, replayed)
    sweep_s = time.perf_counter() - t1
    for r in results:
        r.pop("ttft_ms_samples", None)
    rec = None
    if args.target_hit_rate is not None or args.target_ttft_ms is not None:
        rec = recommend(results, args.target_hit_rate, args.target_ttft_ms, args.ttft_percentile,
                        args.price_cpu_gib, args.price_nvme_gib)
    report = {
        "command": "kvstore plan " + " ".join(getattr(args, "argv", None) or []),
        "model": layout.to_dict(), "workload": args.workload, "requests": len(requests),
        "blocks": sum(r.num_blocks for r in requests), "infinite_cache_hit_rate": ideal,
        "cost_model": {"bandwidth_gbps": bandwidth, "bandwidth_source": bw_source, "prefill_tok_s": prefill,
                       "prefill_source": "given" if args.prefill_tok_s else "preset guess", "rpc_ms": args.rpc_ms,
                       "formula": "rpc_ms + sum_t(bytes_t / bw_t) + codec decode + recomputed_tokens / prefill"},
        "codecs": {c: dataclasses.asdict(CODECS[c]) for c in codecs},
        "store_config": dataclasses.asdict(config) | {"cpu_slot_bytes": slot_bytes},
        "timing": {"load_seconds": round(load_s, 2), "sweep_seconds": round(sweep_s, 2), "jobs": args.jobs},
        "targets": {"hit_rate": args.target_hit_rate, "ttft_ms": args.target_ttft_ms,
                    "percentile": args.ttft_percentile},
        "recommendation": rec, "results": results, "machine": machine_facts(),
    }
    report["cost_model"]["bandwidth_gbps"] = {k: (v if math.isfinite(v) else None) for k, v in bandwidth.items()}
    for c in report["codecs"].values():
        c["decode_gbps"] = c["decode_gbps"] if math.isfinite(c["decode_gbps"]) else None
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, args.out + ".md")
    plot(results, args.out + ".png", f"{layout.model}, {args.workload}, {len(requests):,} requests, "
                                     f"block {args.block_tokens} tokens")
    if not args.quiet:
        render_table(results, console)
        if rec:
            console.print(f"[bold green]recommended[/]: cpu {_gib(rec['cpu_bytes'])}, nvme {_gib(rec['nvme_bytes'])}, "
                          f"codec {rec['codec']}, policy {rec['policy']}: hit {rec['hit_rate']:.1%}, TTFT "
                          f"p{args.ttft_percentile} {rec['ttft_ms'][f'p{args.ttft_percentile}']:.0f} ms")
        elif args.target_hit_rate is not None or args.target_ttft_ms is not None:
            console.print("[bold red]no candidate reaches the target[/]: try larger sizes or another codec")
        console.print(f"wrote {args.out}.json, {args.out}.md and {args.out}.png")
    return report


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

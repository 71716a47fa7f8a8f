"""The planner's cost model: what a codec stores and costs, tier bandwidths, TTFT, the cheapest fit.

TTFT per request is a model, stated in every plan report: ``rpc_ms`` + for each hit tier
``bytes / bandwidth`` (+ codec decode) + ``recomputed tokens / prefill_tok_s``. Bandwidths are
measured on this host (kvstore.ops.ceilings: memcpy for the CPU tier, O_DIRECT reads for NVMe)
unless given. ``recommend`` picks the cheapest replayed candidate that meets the targets.
"""

from __future__ import annotations

import dataclasses
import math

from kvstore.errors import InvalidArgument
from kvstore.keys import KVLayout
from kvstore.units import GiB


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

#: tiers a --bandwidth argument leaves out: figures measured on the development host (peers-and-ceilings.md)
DEFAULT_BANDWIDTH_GBPS = {"cpu": 19.0, "nvme": 3.05}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """TTFT = rpc_ms + sum(bytes per tier / bandwidth) + decode + recomputed tokens / prefill."""

    bandwidth_gbps: dict[str, float]
    prefill_tok_s: float
    rpc_ms: float = 0.5


def ttft_ms(cost: CostModel, codec: Codec, block_bytes: int, layout: KVLayout, got: dict[str, int],
            recompute_tokens: int) -> float:
    """One request's modelled TTFT: ``got`` blocks per tier loaded, ``recompute_tokens`` prefilled."""
    ms = cost.rpc_ms
    raw_loaded = 0
    for name, n in got.items():
        if n:
            ms += n * block_bytes / (cost.bandwidth_gbps[name] * 1e9) * 1e3
            raw_loaded += n * layout.shape_bytes
    if raw_loaded and math.isfinite(codec.decode_gbps):
        ms += raw_loaded / (codec.decode_gbps * 1e9) * 1e3
    return ms + max(0, recompute_tokens) / cost.prefill_tok_s * 1e3


def measure_bandwidth(block_bytes: int, directory: str) -> dict[str, float]:
    """Tier read bandwidth on this host: memcpy (CPU tier), O_DIRECT reads in ``directory`` (NVMe)."""
    from kvstore.ops import ceilings

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

"""The connector's settings, parsed from vLLM's ``kv_connector_extra_config``.

Unknown keys, values of the wrong type and values outside a key's choices are refused at
start-up, by name, rather than ignored: a typo in a deployment's config should fail the launch,
not silently disable caching.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LOAD_MODES = ("sync", "async", "layer")
SAVE_MODES = ("step", "layer")
HASH_ALGORITHMS = ("xxh3_128", "sha256")
#: a chunk of 1024 blocks of 16 tokens is already a 16k-token prompt: beyond that only misses grow
MAX_BLOCKS_PER_CHUNK = 1024
#: a decode request held longer than this waits on a prefill that is not coming: recompute instead
MAX_PD_WAIT_S = 600.0


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    url: str | None = None
    token: str | None = None
    transport: str = "auto"
    lookup_timeout_s: float = 0.5
    timeout_s: float = 5.0
    retry_after_s: float = 5.0
    cache_salt: str = ""
    model_id: str | None = None
    hash_seed: int = 0
    hash_algorithm: str = "xxh3_128"
    load: bool = True
    save: bool = True
    save_decode: bool = True
    load_mode: str = "sync"
    # "step": saved blocks are copied out after the step, on the saver's thread; "layer": each
    # layer's pages as the forward pass computes them (``save_kv_layer``). Default: docs/tuning.md.
    save_mode: str = "step"
    max_pending_saves: int = 64
    # vLLM blocks per kvstore block (1: one each). Default by measurement: docs/tuning.md.
    blocks_per_chunk: int = 1
    # cache-aware admission (``admission``): a request goes first when at least this fraction of
    # its prompt is cached
    admission_hit_fraction: float = 0.5
    # prefill/decode hand-off (``handoff``): how long a consumer waits for the blocks a producer
    # named before it recomputes them, and how often it asks its daemon meanwhile
    pd_wait_s: float = 2.0
    pd_poll_s: float = 0.005
    # how many requests whose hand-off wait ended a consumer lets into one engine step (0: all):
    # each one's load and prompt tail lengthen that step, which every running request waits for
    pd_admit_per_step: int = 1
    # a prompt whose leading blocks another live request of this engine is computing (and will
    # save) waits up to this long for them to reach the daemon, then loads them (0: never waits)
    inflight_wait_s: float = 10.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        out = {}
        for name, value in extra.items():
            kind = known[name].type
            try:
                if kind == "bool":
                    out[name] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
                elif kind == "float":
                    out[name] = float(value)
                elif kind == "int":
                    out[name] = int(value)
                else:
                    out[name] = None if value is None else str(value)
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config.{name}: cannot use {value!r} as {kind}") from None
        for name, choices in (("load_mode", LOAD_MODES), ("save_mode", SAVE_MODES), ("hash_algorithm", HASH_ALGORITHMS)):
            if name in out and out[name] not in choices:
                raise ValueError(f"kv_connector_extra_config.{name}: {out[name]!r} is not one of {list(choices)}")
        if not 1 <= out.get("blocks_per_chunk", 1) <= MAX_BLOCKS_PER_CHUNK:
            raise ValueError(f"kv_connector_extra_config.blocks_per_chunk: {out['blocks_per_chunk']!r} is not "
                             f"in [1, {MAX_BLOCKS_PER_CHUNK}] (vLLM blocks per kvstore block)")
        if not 0.0 <= out.get("admission_hit_fraction", 0.5) <= 1.0:
            raise ValueError(f"kv_connector_extra_config.admission_hit_fraction: "
                             f"{out['admission_hit_fraction']!r} is not in [0, 1]")
        if not 0.0 <= out.get("pd_wait_s", 2.0) <= MAX_PD_WAIT_S:
            raise ValueError(f"kv_connector_extra_config.pd_wait_s: {out['pd_wait_s']!r} is not in "
                             f"[0, {MAX_PD_WAIT_S}] (seconds a consumer waits for a producer's blocks)")
        if not 0.0 <= out.get("inflight_wait_s", 10.0) <= MAX_PD_WAIT_S:
            raise ValueError(f"kv_connector_extra_config.inflight_wait_s: {out['inflight_wait_s']!r} is not in "
                             f"[0, {MAX_PD_WAIT_S}] (seconds a request waits for blocks another one computes)")
        if out.get("pd_admit_per_step", 1) < 0:
            raise ValueError(f"kv_connector_extra_config.pd_admit_per_step: {out['pd_admit_per_step']!r} is "
                             "below 0 (hand-off requests let into one engine step; 0: no limit)")
        if not 0.0 < out.get("pd_poll_s", 0.005) <= 1.0:
            raise ValueError(f"kv_connector_extra_config.pd_poll_s: {out['pd_poll_s']!r} is not in (0, 1]")
        return cls(**out)

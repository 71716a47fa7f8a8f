"""The planner's replay: a workload through the production Store over metadata-only tiers.

The replay builds the production ``Store`` with the production eviction policies over
``MetadataTier``s (sizes, no bytes) and, per request, does what a connector does: ``lookup`` the
longest cached prefix, ``get`` the hits, ``put`` the misses. Every eviction, demotion, promotion
and lease decision is therefore the real one; only the payload copies are skipped. Each
candidate (policy x codec x CPU size x NVMe size) is one replay; ``sweep`` runs candidates in
parallel.

Leases are real too: the replay runs the store on the trace's clock (``TraceClock``), so a block
looked up at t is pinned until t + lease_seconds of *trace* time, whatever the replay speed.

Codecs are modelled by the size a block takes: exactly the payload ``kvstore.codecs`` produces for
the model's layout (a daemon with ``codecs.cpu`` stores every block in that form: put, promotion,
demotion; see ``kvstore.store.transcoding``), raw when the codec cannot read the layout; a codec
known only to the cost table (``--codec-table``) by its ratio. ``replay(..., real_codec=True)``
runs the same trace through a store that really encodes (tests compare the two).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, StoreFull
from kvstore.keys import KVLayout, Namespace
from kvstore.ops import workload as workloads
from kvstore.ops.plan_cost import CODECS, CostModel, ttft_ms
from kvstore.store import Store, StoreConfig
from kvstore.store.policy import POLICIES
from kvstore.tiers.metadata import MetadataTier
from kvstore.wire import MAX_BATCH


# -- the trace clock -------------------------------------------------------------------------------

class TraceClock:
    """The replay's clock: leases expire in trace time, not wall time (given to the Store)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- one replay ------------------------------------------------------------------------------------

#: the tiers a candidate has (a policy spec may name each)
PLAN_TIERS = ("cpu", "nvme")


def parse_policy(spec: str) -> str | dict[str, str]:
    """A candidate's eviction policy as ``StoreConfig.eviction_policy`` takes it: a policy name for
    every tier (``s3fifo``), or one per tier, ``cpu=s3fifo+nvme=lru`` (a tier not named gets
    ``prefix``, as with the daemon's ``eviction_policy`` mapping)."""
    spec = spec.strip()
    if "=" not in spec:
        if spec not in POLICIES:
            raise InvalidArgument("policy", f"unknown policy {spec!r}; one of {sorted(POLICIES)}, or per tier "
                                            "as cpu=POLICY+nvme=POLICY")
        return spec
    per_tier: dict[str, str] = {}
    for part in spec.split("+"):
        tier, _, name = (x.strip() for x in part.partition("="))
        if tier not in PLAN_TIERS:
            raise InvalidArgument("policy", f"{spec!r}: unknown tier {tier!r}; one of {list(PLAN_TIERS)}")
        if tier in per_tier:
            raise InvalidArgument("policy", f"{spec!r}: tier {tier!r} named twice")
        if name not in POLICIES:
            raise InvalidArgument(f"policy.{tier}", f"{spec!r}: unknown policy {name!r}; one of {sorted(POLICIES)}")
        per_tier[tier] = name
    return per_tier


@dataclasses.dataclass(frozen=True)
class Candidate:
    policy: str          # a policy name, or one per tier: "cpu=s3fifo+nvme=lru" (``parse_policy``)
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
    used_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # per tier, at the end
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
            "bytes_demoted": self.bytes_demoted, "bytes_promoted": self.bytes_promoted, "used_bytes": self.used_bytes,
            "ttft_ms": {f"p{p}": self.ttft_percentile(p) for p in (50, 90, 99)}
            | {"mean": float(self.ttft_ms.mean()) if self.ttft_ms is not None and len(self.ttft_ms) else 0.0},
            "counters": self.counters, "replay_seconds": round(self.seconds, 2),
        }



def metadata_tiers(c: Candidate, slot_bytes: int) -> list[MetadataTier]:
    tiers = []
    if c.cpu_bytes:
        tiers.append(MetadataTier.like_cpu(c.cpu_bytes, slot_bytes))
    if c.nvme_bytes:
        tiers.append(MetadataTier.like_nvme(c.nvme_bytes))
    if not tiers:
        raise InvalidArgument("tier sizes", "a candidate needs a CPU or an NVMe tier (both are 0)")
    return tiers


#: cost-table codec names that stand for a daemon codec of another name
DAEMON_CODECS = {"int4": "int4_g64"}
#: a replay reports the requests it has replayed in batches of this many
PROGRESS_BATCH = 256
#: how often a parallel sweep reads its workers' request count while it waits (seconds)
POLL_S = 0.25
#: the byte order the planner sizes a model's blocks in when it is not told one (a layout the codecs read)
MODELLED_ORDER = "kv,layer,token,head,dim"


def daemon_codec(codec: str) -> str | None:
    """The ``kvstore.codecs`` codec a planner codec stands for (None: raw, or only in the cost table)."""
    name = DAEMON_CODECS.get(codec, codec)
    if name == "raw":
        return None
    from kvstore.codecs import CODEC_IDS
    return name if name in CODEC_IDS else None


def codec_unavailable(codec: str) -> str | None:
    """Why the planner cannot model ``codec`` in this install (it encodes a real block with the
    daemon's codec, and fp8 / int4 need torch), or None."""
    name = daemon_codec(codec)
    if name is None:
        return None
    from kvstore.codecs import unavailable
    return unavailable(name)


def modelled_layout(layout: KVLayout) -> KVLayout:
    """The planner knows a model's shape, not its engine's byte order: an opaque layout is sized as
    the canonical order, which the codecs read."""
    return dataclasses.replace(layout, layout=MODELLED_ORDER) if layout.layout == "opaque" else layout


def sample_block(layout: KVLayout) -> np.ndarray:
    """A finite block of ``layout`` (section codecs' payload size does not depend on the values)."""
    import torch   # only for the lossy codecs, which need it (``codec_unavailable``)
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return np.zeros(layout.block_bytes, dtype=np.uint8)
    n = layout.block_bytes // torch.empty((), dtype=dtype).element_size()
    values = torch.linspace(-1, 1, n, dtype=torch.float32).to(dtype)
    return values.view(torch.uint8).numpy().copy()


@functools.lru_cache(maxsize=64)
def stored_block_bytes(layout: KVLayout, codec: str) -> int:
    """Bytes the daemon stores one block in with ``codec``: the encoded payload's size, or raw when
    the codec cannot read the layout or its encoding would not be smaller (as the daemon decides);
    a cost-table-only codec: raw / its ratio."""
    name = daemon_codec(codec)
    if name is None:
        return max(1, math.ceil(layout.shape_bytes / CODECS[codec].ratio)) if codec != "raw" else layout.block_bytes
    from kvstore import codecs
    real = modelled_layout(layout)
    try:
        codecs.check_layout(name, real)
        _, payload = codecs.encode_block(name, sample_block(real), real)
    except codecs.CodecError:
        return layout.block_bytes
    return min(payload.nbytes, layout.block_bytes)


def stored_layout(layout: KVLayout, codec: str) -> KVLayout:
    """The layout whose block size is what the codec stores (the planner's model of a codec)."""
    return dataclasses.replace(layout, block_bytes=stored_block_bytes(layout, codec))


def replay(requests: Iterable[workloads.Request], layout: KVLayout, candidate: Candidate,
           cost: CostModel | None = None, config: StoreConfig | None = None,
           tiers: Sequence | None = None, slot_bytes: int = 256 * 1024, keep_hit_tiers: bool = False,
           on_progress: Callable[[int], None] | None = None, real_codec: bool = False) -> ReplayResult:
    """Replay ``requests`` through a real Store: lookup, get the hits, put the misses.

    ``tiers`` defaults to metadata tiers for ``candidate``; tests pass real tiers to check that
    both give the same answer. ``on_progress`` hears each ``PROGRESS_BATCH`` requests replayed
    (the number more since it last heard, the rest at the end). ``real_codec``: instead of modelling the codec by block size, put
    real blocks of the layout into a store whose first tier has the codec (``codecs.cpu``), which
    encodes them as a daemon does (needs tiers that keep bytes).
    """
    config = dataclasses.replace(config or StoreConfig(), eviction_policy=parse_policy(candidate.policy))
    own_tiers = tiers is None
    tiers = list(tiers) if tiers is not None else metadata_tiers(candidate, slot_bytes)
    block_bytes = stored_block_bytes(layout, candidate.codec)
    if real_codec:
        ns = Namespace(modelled_layout(layout), cache_salt="kvstore-plan")
        name = daemon_codec(candidate.codec)
        if name is not None:
            config = dataclasses.replace(config, tier_codecs={tiers[0].name: name})
        payload = sample_block(ns.layout)
    else:
        ns = Namespace(stored_layout(layout, candidate.codec), cache_salt="kvstore-plan")
        payload = np.zeros(block_bytes, dtype=np.uint8)   # one buffer, reused for every put
    names = [t.name for t in tiers]
    hit_blocks = dict.fromkeys(names, 0)
    codec = CODECS[candidate.codec]
    ttfts: list[float] = []
    hit_tiers: list[tuple[int, ...]] = []
    blocks = misses = rejected = n_requests = 0
    started = time.perf_counter()
    reported = 0
    clock = TraceClock()
    store = Store(tiers, config, clock=clock)
    try:
        ns_id = store.register_namespace(ns)
        outs = [np.empty(ns.block_bytes, dtype=np.uint8)] * MAX_BATCH   # every get's destination
        for req in requests:
            clock.now = req.t
            hashes = req.hash_list()
            got = dict.fromkeys(names, 0)
            n_hit = 0
            for lo in range(0, len(hashes), MAX_BATCH):
                chunk = hashes[lo:lo + MAX_BATCH]
                n = store.lookup(ns_id, chunk).num_hit
                n_hit += _get_hits(store, ns_id, chunk[:n], outs, got)
                if n < len(chunk) or n_hit < lo + n:
                    break
            for lo in range(n_hit, len(hashes), MAX_BATCH):
                chunk = hashes[lo:lo + MAX_BATCH]
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
            if on_progress is not None and n_requests - reported >= PROGRESS_BATCH:
                on_progress(n_requests - reported)
                reported = n_requests
            if keep_hit_tiers:
                hit_tiers.append(tuple(got[n] for n in names))
            if cost is not None:
                ttfts.append(ttft_ms(cost, codec, block_bytes, layout, got, req.tokens - n_hit * layout.block_tokens))
        if on_progress is not None and n_requests > reported:
            on_progress(n_requests - reported)
        counters = dict(store.counters)
        placed = {t.name: getattr(t, "bytes_placed", None) for t in tiers}
        used = {t.name: t.used_bytes for t in tiers}
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
        bytes_promoted=counters.get("promotions", 0) * block_bytes, used_bytes=used,
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



# -- the sweep -------------------------------------------------------------------------------------

_SHARED: dict = {}


def _replay_shared(candidate: Candidate) -> dict:
    s = _SHARED
    result = replay(s["requests"], s["layout"], candidate, s["cost"], s["config"], slot_bytes=s["slot_bytes"],
                    on_progress=s["on_progress"])
    out = result.summary()
    out["ttft_ms_samples"] = None
    return out


def _count_in(shared) -> Callable[[int], None]:
    """A worker's ``on_progress``: adds its requests to the count its parent process reads."""
    def add(n: int) -> None:
        with shared.get_lock():
            shared.value += n
    return add


def sweep(requests: list[workloads.Request], layout: KVLayout, candidates: list[Candidate], cost: CostModel,
          config: StoreConfig, slot_bytes: int, jobs: int, progress: Callable[[dict], None] | None = None,
          on_requests: Callable[[int], None] | None = None) -> list[dict]:
    """Replay every candidate (in ``jobs`` forked processes sharing the request list).
    ``progress`` hears each candidate's result as it is done; ``on_requests`` the requests
    replayed so far over all candidates and processes, as they advance (each ``PROGRESS_BATCH``
    serially; every ``POLL_S`` from parallel workers, through a count in shared memory)."""
    serial = jobs <= 1 or len(candidates) == 1
    for c in {c.codec for c in candidates}:
        stored_block_bytes(layout, c)   # sized once here, not in every forked worker
    context = multiprocessing.get_context("fork")
    replayed = context.Value("q", 0)
    _SHARED.update(requests=requests, layout=layout, cost=cost, config=config, slot_bytes=slot_bytes,
                   on_progress=_count_in(replayed))

    def heard() -> None:
        if on_requests is not None:
            on_requests(replayed.value)

    if serial and on_requests is not None:
        count = _SHARED["on_progress"]

        def count_and_tell(n: int) -> None:
            count(n)
            heard()
        _SHARED["on_progress"] = count_and_tell
    results = []
    try:
        if serial:
            for c in candidates:
                results.append(_replay_shared(c))
                if progress:
                    progress(results[-1])
        else:
            with context.Pool(jobs) as pool:
                done = pool.imap(_replay_shared, candidates)
                while len(results) < len(candidates):
                    try:
                        r = done.next(timeout=POLL_S)
                    except multiprocessing.TimeoutError:
                        heard()
                        continue
                    results.append(r)
                    if progress:
                        progress(r)
                    heard()
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

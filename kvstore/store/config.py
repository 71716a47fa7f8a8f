"""The knobs a Store is built with (the daemon fills them from its settings, the planner from its sweep)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StoreConfig:
    #: a policy name (``lru``, ``prefix``, ``s3fifo``) for every tier, or a mapping tier name ->
    #: policy name (``{"cpu": "s3fifo", "nvme": "lru"}``); tiers a mapping does not name get
    #: ``prefix``, and names of tiers the store does not have are unused (kvstore.store.policy)
    eviction_policy: str | dict[str, str] = "prefix"
    write_through: bool = False
    promote_on_hit: bool = True
    lease_seconds: float = 5.0
    #: tier name -> codec name (kvstore.codecs); absent = raw. Blocks are transcoded when they
    #: move into a tier (demotion, write-through, flush, promotion) and decoded on every read.
    tier_codecs: dict[str, str] = dataclasses.field(default_factory=dict)
    #: tenant -> the most bytes its blocks (and reservations) may occupy; absent = unlimited
    tenant_quotas: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the largest block a namespace may declare (None: only the tiers bound it)
    max_block_bytes: int | None = None
    #: every tier must hold at least this many of the largest blocks (0: a block need only fit
    #: the largest tier). The daemon sets it so one namespace cannot declare tier-sized blocks.
    min_blocks_per_tier: int = 0
    #: namespaces one tenant may register (None: unbounded)
    max_namespaces_per_tenant: int | None = None

"""The knobs a Store is built with (the daemon fills them from its settings, the planner from its sweep)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StoreConfig:
    eviction_policy: str = "prefix"
    write_through: bool = False
    promote_on_hit: bool = True
    lease_seconds: float = 5.0
    #: tier name -> codec name (kvstore.codecs); absent = raw. Blocks are transcoded when they
    #: move into a tier (demotion, write-through, flush, promotion) and decoded on every read.
    tier_codecs: dict[str, str] = dataclasses.field(default_factory=dict)

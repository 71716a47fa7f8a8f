"""What client and daemon must agree on besides the .proto: limits, metadata keys, result types.

A leaf imported by both ends (and by the store, whose limits are the wire's), so a limit changed
here changes on both sides at once. Imports nothing from kvstore.
"""

from __future__ import annotations

import dataclasses

PROTOCOL_VERSION = 1
DEFAULT_URL = "127.0.0.1:7373"
MAX_BATCH = 4096            # hashes per RPC
MAX_LOOKUP_BATCH = 1024     # chains per LookupBatch
MAX_LOOKUP_HASHES = 65536   # hashes per LookupBatch, all its chains together
MAX_STRING = 256            # longest model / tenant / salt string accepted
RAW_CODEC = 0               # codec id of an unencoded block
SERVER_ID_KEY = "kvstore-server-id"   # trailing metadata of lease RPCs: which daemon run answered
UNSTAGED_KEY = "kvstore-unstaged"     # PrepareLoad stopped at a present block it could not stage
CAPPED_KEY = "kvstore-lease-capped"   # PrepareLoad stopped at its tenant's lease budget (ask again once released)


@dataclasses.dataclass
class Lookup:
    """How much of a chain is cached: the leading run of present blocks and where each lives."""

    num_hit: int          # leading blocks present
    tiers: list[str]      # tier of each of those blocks

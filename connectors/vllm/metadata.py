"""What the scheduler hands the workers each step (loads and saves), and the connector's counters.

vLLM ships the metadata from the scheduler process to the workers and aggregates the stats
across workers, so both are plain dataclasses of vLLM's base types.
"""

from __future__ import annotations

import dataclasses
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move: kvstore hashes and, for each, the ``blocks_per_chunk`` vLLM
    block ids it holds, in order (``block_ids[i*N:(i+1)*N]`` for ``hashes[i]``; N = 1: aligned).
    A load marks with -1 the vLLM blocks of a chunk it must not place: vLLM's own prefix cache
    computed them already (they may be shared with running requests)."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    parent: bytes | None = None   # hash of the block before hashes[0] (saves; eviction uses it)
    asynchronous: bool = False    # loads: lands between steps, reported through get_finished
    # saves: the request hands its prompt off to a decode engine (a producer's, or a ``kv_both``
    # request with ``do_remote_decode``): its worker waits for the put as the request finishes
    handoff: bool = False


@dataclasses.dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    load_mode: str = "sync"
    # requests preempted this step: their blocks may be handed to others before the forward pass,
    # so saves still reading them must finish first (``handle_preemptions``)
    preempted: bool = False


@dataclasses.dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters since the last report (vLLM logs ``reduce()`` as "KV Transfer metrics")."""

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, n: int | float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for k, v in (other.data or {}).items():
            self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counters:
    """The connector's counters, added to by both roles and their threads: those since vLLM last
    collected them (``collect``) and those since start (``totals``: tests, benchmarks)."""

    def __init__(self) -> None:
        self._since_collected = KVStoreConnectorStats()
        self.totals: dict[str, int | float] = {}
        self._lock = threading.Lock()

    def add(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._since_collected.add(key, n)
            self.totals[key] = self.totals.get(key, 0) + n

    def collect(self) -> KVStoreConnectorStats | None:
        """The counters since the last call (None when nothing happened), starting afresh."""
        with self._lock:
            if self._since_collected.is_empty():
                return None
            out, self._since_collected = self._since_collected, KVStoreConnectorStats()
        return out

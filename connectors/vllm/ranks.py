"""Who stores what under tensor / pipeline parallelism, and what the scheduler looks up.

Each (TP rank, PP rank) worker holds its own shard of every block and stores it under its own
namespace (``identity.namespace_for``). MLA's latent KV is the same on every TP rank: TP rank 0
alone writes it, under a rank-free namespace, and every rank reads it.

The scheduler offers a block only when every TP rank's namespace holds it (one lookup per
namespace; the answer is the shortest). Pipeline stages other than the first are not looked up:
vLLM gives the scheduler the first stage's KV cache config, and a stage with another layer count
has another namespace, so its name cannot be derived there; a stage that misses reports load
errors and vLLM recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.identity import namespace_for
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def lookup_namespaces(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                      settings: ConnectorSettings) -> list[Namespace]:
    """The distinct namespaces the scheduler looks up: every TP rank's of the first PP stage
    (one for MLA). Empty when the model is unsupported."""
    out: dict[bytes, Namespace] = {}
    for tp in range(int(vllm_config.parallel_config.tensor_parallel_size)):
        ns = namespace_for(vllm_config, kv_cache_config, settings, tp, 0)
        if ns is None:
            return []
        out.setdefault(ns.id, ns)
    return list(out.values())


def hits_on_every_rank(handles: Sequence[NamespaceHandle], hashes: Sequence[bytes], lease: bool = True,
                       local_only: bool = False) -> int:
    """Leading blocks that every handle's namespace holds (with ``lease``, each lookup pins what
    it found until the blocks are loaded; ``local_only``: on each daemon itself, no fleet peer)."""
    num_hit = len(hashes)
    for handle in handles:
        if num_hit == 0:
            break
        num_hit = min(num_hit, handle.lookup(hashes[:num_hit], lease, local_only).num_hit)
    return num_hit if handles else 0


def is_writer(namespace: Namespace, tp_rank: int) -> bool:
    """Whether this worker saves: every rank for sharded KV, TP rank 0 alone for MLA."""
    return namespace.layout.tp_size > 1 or tp_rank == 0


def worker_ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed setup."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001
        return 0, 0

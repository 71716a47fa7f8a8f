"""What a vLLM block is called in kvstore: its namespace (shape, layout, shard) and chain hashes.

Both are derived from vLLM's configuration and the request alone, never from tensors, so the
scheduler (which has no tensors) and every worker compute the same names.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import DTYPE_SIZES, ChainHasher, KVLayout, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_name(device_type: str) -> str:
    """Names the byte order of a block. CPU pages are the CPU attention kernel's packing
    (K transposed per head); other devices get their own name, so they never share with CPU."""
    return "vllm_cpu" if device_type == "cpu" else f"vllm_{device_type}"


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", settings: ConnectorSettings,
                  tp_rank: int = 0, pp_rank: int = 0) -> Namespace | None:
    """The namespace a worker with these ranks stores into; None if this model is unsupported."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        logger.warning("kvstore connector: %d KV cache groups (hybrid model); disabled", len(groups))
        return None
    spec = groups[0].kv_cache_spec
    needed = ("num_kv_heads", "head_size", "dtype", "block_size", "page_size_bytes")
    if not all(hasattr(spec, a) for a in needed):
        logger.warning("kvstore connector: KV cache spec %s is not attention; disabled", type(spec).__name__)
        return None
    dtype = dtype_name(spec.dtype)
    if dtype not in DTYPE_SIZES:
        logger.warning("kvstore connector: KV dtype %s unsupported; disabled", dtype)
        return None
    pc = vllm_config.parallel_config
    model = settings.model_id or str(vllm_config.model_config.model)
    layout = KVLayout(model=model, num_layers=len(groups[0].layer_names), num_kv_heads=int(spec.num_kv_heads),
                      head_dim=int(spec.head_size), dtype=dtype, block_tokens=int(spec.block_size),
                      layout=layout_name(vllm_config.device_config.device_type),
                      tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size),
                      pp_rank=pp_rank, pp_size=int(pc.pipeline_parallel_size),
                      block_bytes=int(spec.page_size_bytes) * len(groups[0].layer_names))
    return Namespace(layout, cache_salt=settings.cache_salt)


def worker_ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed setup."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001
        return 0, 0


def prompt_block_hashes(hasher: ChainHasher, request: "Request", block_tokens: int) -> list[bytes]:
    """kvstore chain hashes of the prompt's full blocks, with vLLM's per-block extra keys
    (LoRA name, multimodal identifiers, cache salt, prompt-embeds digests) mixed in exactly where
    vLLM mixes them into its own hashes. Empty when the prompt cannot be keyed."""
    tokens = request.prompt_token_ids
    if not tokens:
        return []
    n_blocks = len(tokens) // block_tokens
    extra = None
    if (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
            or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        extra, mm_idx = [], 0
        for i in range(n_blocks):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * block_tokens, (i + 1) * block_tokens, mm_idx)
            extra.append(keys)
    return hasher.chain(tokens[:n_blocks * block_tokens], block_tokens, extra_keys=extra)

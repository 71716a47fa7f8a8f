"""What a vLLM block is called in kvstore: its namespace (shape, layout, shard) and chain hashes.

Both are derived from vLLM's configuration and the request alone, never from tensors, so the
scheduler (which has no tensors) and every worker compute the same names. Nothing here imports
vLLM at module level, so the naming rules can be tested without an engine.

Sharding: with tensor or pipeline parallelism each worker holds a different shard of every block,
so each (TP rank, PP rank) stores under its own namespace. MLA models keep one latent vector per
token that every TP rank holds identically: they store it once, under a namespace without the TP
rank (``tp_size`` 1); ``ranks`` says who writes and what the scheduler looks up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import DTYPE_SIZES, ChainHasher, KVLayout, Namespace, determinism_self_check

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.connectors.vllm")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_name(device_type: str, mla: bool = False) -> str:
    """Names the byte order of a block, precisely enough for a codec to find layers, K/V, tokens,
    heads and dims (``kvstore.codecs.layout``). CPU pages are the CPU attention kernel's packing
    (K transposed per head). On GPUs a stored block is each layer's page for it in the attention
    backend's logical order with the block axis taken out (``PagedBlocks.gather``): FlashAttention
    ``[2, num_blocks, block_size, heads, head_size]`` and FlashInfer ``[num_blocks, 2, block_size,
    heads, head_size]`` both give ``layer,kv,token,head,dim``; MLA latent pages ``[num_blocks,
    block_size, kv_lora_rank + rope_dim]`` give ``layer,token,dim``. The worker checks its tensors
    have that page shape (``page_shape_matches``) and disables itself otherwise. Different names
    for CPU and GPU blocks keep them in different namespaces."""
    if device_type == "cpu":
        return "vllm_cpu"
    return "layer,token,dim" if mla else "layer,kv,token,head,dim"


def page_shape_matches(layout: "KVLayout", page_shapes: list[tuple[int, ...]], blocks_per_chunk: int = 1) -> bool:
    """Whether every layer's page (its tensor with the block axis removed, logical order) has the
    shape ``layout.layout`` promises for one vLLM block (a stored block holds ``blocks_per_chunk``
    of them, ``chunks``); vllm_cpu's packing is checked by size alone (block_bytes)."""
    if layout.layout == "vllm_cpu":
        return True
    tokens = layout.block_tokens // blocks_per_chunk
    want = ((tokens, layout.head_dim) if layout.layout == "layer,token,dim" else
            (2, tokens, layout.num_kv_heads, layout.head_dim))
    return all(tuple(s) == want for s in page_shapes)


def is_mla(vllm_config: "VllmConfig", spec: Any) -> bool:
    """MLA stores one latent vector per token, identical on every TP rank."""
    return bool(getattr(vllm_config.model_config, "use_mla", False)) or "MLA" in type(spec).__name__


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", settings: ConnectorSettings,
                  tp_rank: int = 0, pp_rank: int = 0) -> Namespace | None:
    """The namespace a worker with these ranks stores into; None if this model is unsupported.
    With ``blocks_per_chunk`` N a stored block is N vLLM blocks: ``block_tokens`` and
    ``block_bytes`` say so, so each N has its own namespace (N = 1: one vLLM block per stored block)."""
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
    mla = is_mla(vllm_config, spec)
    tp_rank, tp_size = (0, 1) if mla else (tp_rank, int(pc.tensor_parallel_size))
    model = settings.model_id or str(vllm_config.model_config.model)
    n = settings.blocks_per_chunk   # a stored block is a chunk of n vLLM blocks (``chunks``)
    layout = KVLayout(model=model, num_layers=len(groups[0].layer_names), num_kv_heads=int(spec.num_kv_heads),
                      head_dim=int(spec.head_size), dtype=dtype, block_tokens=n * int(spec.block_size),
                      layout=layout_name(vllm_config.device_config.device_type, mla), kv_per_token=1 if mla else 2,
                      tp_rank=tp_rank, tp_size=tp_size,
                      pp_rank=pp_rank, pp_size=int(pc.pipeline_parallel_size),
                      block_bytes=n * int(spec.page_size_bytes) * len(groups[0].layer_names))
    return Namespace(layout, cache_salt=settings.cache_salt)


def checked_hasher(settings: ConnectorSettings) -> ChainHasher | None:
    """The block hasher, or None (connector disabled, logged) if this build's hashing does not
    match the pinned known answers: blocks stored by other processes would never be found, and
    this process's blocks would poison nothing but waste the store."""
    try:
        determinism_self_check()
        return ChainHasher(settings.hash_algorithm, seed=settings.hash_seed)
    except Exception as e:  # noqa: BLE001
        logger.error("kvstore connector DISABLED: the block-hash self-check failed (%s); this process "
                     "would not find blocks other processes stored", e)
        return None


def block_hashes(hasher: ChainHasher, request: "Request", block_tokens: int, start_block: int, end_block: int,
                 parent: bytes | None) -> list[bytes]:
    """kvstore chain hashes of blocks ``[start_block, end_block)`` of the request's tokens (prompt,
    then generated), chained from ``parent`` (the hash of block ``start_block - 1``), with vLLM's
    per-block extra keys (LoRA name, multimodal identifiers, cache salt, prompt-embeds digests)
    mixed in exactly where vLLM mixes them into its own hashes."""
    if end_block <= start_block:
        return []
    bt = block_tokens
    tokens = request.all_token_ids[start_block * bt:end_block * bt]
    extra = None
    if (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
            or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        extra, mm_idx = [], 0
        for i in range(start_block, end_block):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * bt, (i + 1) * bt, mm_idx)
            extra.append(keys)
    return hasher.chain(tokens, bt, parent=parent, extra_keys=extra)


def prompt_block_hashes(hasher: ChainHasher, request: "Request", block_tokens: int) -> list[bytes]:
    """Hashes of the prompt's full blocks. Empty when the prompt cannot be keyed."""
    tokens = request.prompt_token_ids
    if not tokens:
        return []
    return block_hashes(hasher, request, block_tokens, 0, len(tokens) // block_tokens, None)

"""Blocks of KV-like bf16 values for codec tests: seeded, so a test can rebuild any block."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.keys import ChainHasher, KVLayout


def kv_block(layout: KVLayout, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_bytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().copy()


def chain(layout: KVLayout, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    """``n`` chained hashes and their blocks."""
    hashes = ChainHasher(seed=seed).chain(np.arange(n * layout.block_tokens) + seed * 7919, layout.block_tokens)
    return hashes, [kv_block(layout, 1000 * seed + i) for i in range(n)]

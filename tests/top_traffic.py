"""Deterministic traffic for ``kvstore top``'s screen tests and screenshots: eight namespaces of
different sizes, some lookups and gets. ``python tests/top_traffic.py HOST:PORT``."""

from __future__ import annotations

import sys

import numpy as np

MODELS = ["acme/chat-v1", "acme/chat-v2", "acme/coder", "meta-llama/Llama-3.1-8B-Instruct", "qwen/Qwen2.5-7B",
          "mistral/Mistral-7B", "acme/summarizer", "acme/rag-embedder"]


def fill(address: str) -> None:
    from kvstore.client import Client
    from kvstore.keys import ChainHasher, KVLayout, Namespace

    with Client(address, transport="grpc") as c:
        for i, model in enumerate(MODELS):
            layout = KVLayout(model, num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
            ns = c.register_namespace(Namespace(layout))
            n = 3 + 4 * (len(MODELS) - i)
            hashes = ChainHasher().chain(np.arange(n * 16) + 1000 * i, 16)
            c.put(ns, hashes, [np.full(layout.block_bytes, j, np.uint8) for j in range(n)])
            c.lookup(ns, hashes[: n // 2] + ChainHasher(seed=5).chain(np.arange(32), 16))
            c.get(ns, hashes[: n // 3])


if __name__ == "__main__":
    fill(sys.argv[1])

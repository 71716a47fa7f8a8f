"""Run in the vLLM venv by tests/test_vllm_chunking.py: layer-wise loads from a daemon over the
side channel (``LoadJob.fetch_by_layers``), against a real daemon. Three layers, so two ranged
gets (layer 0, then layers 1-2): every layer of every planned block is placed as stored; a block
deleted from the daemon between the two gets is a load error while the others are placed; chunks
of two vLLM blocks load by layers the same way.

    python vllm_layer_fetch.py DAEMON_URL      # prints one JSON line
"""

import json
import sys

import torch

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.loader import LoadJob
from kvstore.connectors.vllm.metadata import BlockTransfer
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.keys import KVLayout, Namespace

NB, T, H, D, LAYERS = 8, 16, 2, 32, 3
url = sys.argv[1]
g = torch.Generator().manual_seed(9)
src = {f"l{i}": torch.randn(NB, H, T, 2 * D, generator=g).to(torch.bfloat16) for i in range(LAYERS)}   # CPU pages
paged_src = PagedBlocks(src, list(src), NB)


class DeletesAfterFirstGet:
    """A real handle that deletes one block from the daemon right after the first ranged get."""

    def __init__(self, handle, victim):
        self.handle, self.victim, self.calls = handle, victim, 0

    def get_into(self, hashes, outs, byte_range=None):
        got = self.handle.get_into(hashes, outs, byte_range=byte_range)
        self.calls += 1
        if self.calls == 1:
            assert self.handle.delete([self.victim]) == 1
        return got


def run(n: int, plan: list[int], deleting: bool) -> dict:
    layout = KVLayout(f"test/layer-fetch-{n}-{deleting}", LAYERS, H, D, "bfloat16", n * T, layout="vllm_cpu",
                      block_bytes=n * paged_src.block_bytes)
    handle = NamespaceHandle(Namespace(layout), url=url, transport="bulk")
    packing = ChunkPacking(layout, paged_src.page_bytes, paged_src.page_shapes, n) if n > 1 else None
    chunks = len(plan) // n
    hashes = [bytes([n, int(deleting), i]) * 5 + b"x" for i in range(chunks)]
    rows = paged_src.host_buffer(chunks * n)
    paged_src.gather(list(range(chunks * n)), rows)            # chunk c = source blocks c*n .. c*n+n-1
    stored = packing.to_chunks(rows) if packing is not None else rows
    assert handle.put(hashes, [stored[c].numpy() for c in range(chunks)])
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    paged_dst = PagedBlocks(dst, list(dst), NB)
    job = LoadJob([BlockTransfer("r", plan, hashes)], paged_dst, packing=packing)
    job.by_layers = True
    job.fetch_by_layers(DeletesAfterFirstGet(handle, hashes[-1]) if deleting else handle)
    job.scatter()
    placed = {b: all(torch.equal(dst[k][b], src[k][j]) for k in src) for j, b in enumerate(plan) if b >= 0}
    untouched = [b for b in range(NB) if b not in plan and any(dst[k][b].any() for k in dst)]
    handle.close()
    return {"good": job.good, "bad": sorted(job.bad), "placed": placed, "written_elsewhere": untouched,
            "ranged_gets": job.ranged_gets}


print(json.dumps({"blocks": run(1, [3, -1, 5], False), "deleted": run(1, [3, 4, 5], True),
                  "chunks": run(2, [-1, 2, 6, 7], False)}))

"""Run in the vLLM venv by tests/test_vllm_chunking.py: a load of chunks (2 vLLM blocks per kvstore
block) against a real daemon where the first chunk arrived and the second did not. The arrived
chunk's blocks are placed, except the one the plan marks -1 (vLLM's own cache holds it); every
vLLM block of the missing chunk is a load error; nothing else is touched.

    python vllm_chunk_loads.py DAEMON_URL      # prints one JSON line
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

NB, T, H, D, N = 8, 16, 2, 32, 2
url = sys.argv[1]
g = torch.Generator().manual_seed(5)
src = {f"l{i}": torch.randn(NB, H, T, 2 * D, generator=g).to(torch.bfloat16) for i in range(2)}   # CPU pages
dst = {k: torch.zeros_like(v) for k, v in src.items()}
paged_src, paged_dst = PagedBlocks(src, list(src), NB), PagedBlocks(dst, list(dst), NB)
layout = KVLayout("test/chunk-loads", 2, H, D, "bfloat16", N * T, layout="vllm_cpu", block_bytes=N * paged_src.block_bytes)
packing = ChunkPacking(layout, paged_src.page_bytes, paged_src.page_shapes, N)
handle = NamespaceHandle(Namespace(layout), url=url)
hashes = [bytes([i]) * 16 for i in (1, 2)]
blocks = paged_src.host_buffer(N)
paged_src.gather([0, 1], blocks)                          # chunk 1 = source blocks 0 and 1; chunk 2 is never stored
assert handle.put(hashes[:1], [packing.to_chunks(blocks)[0].numpy()])
# plan: chunk 1 -> vLLM blocks (-1: already computed, 5), chunk 2 -> vLLM blocks 6, 7
job = LoadJob([BlockTransfer("r", [-1, 5, 6, 7], hashes)], paged_dst, packing=packing)
job.fetch(handle)
job.scatter()
stats = {}
job.add_stats(lambda k, v: stats.__setitem__(k, stats.get(k, 0) + v))
placed = all(torch.equal(dst[k][5], src[k][1]) for k in src)
untouched = [b for b in range(NB) if any(dst[k][b].any() for k in dst) and b != 5]
print(json.dumps({"good": job.good, "bad": sorted(job.bad), "placed_block_5": placed, "untouched_written": untouched,
                  "stats": stats}))
handle.close()

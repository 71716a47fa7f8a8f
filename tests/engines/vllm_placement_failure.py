"""Run in the vLLM venv by tests/test_vllm_connector.py: a load whose placement into vLLM's KV
cache fails must become load errors (recompute), never an exception in the engine's step.

    python placement_failure.py DAEMON_URL      # prints one JSON line
"""

import json, sys
import torch
from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.loader import LoadJob
from kvstore.connectors.vllm.metadata import BlockTransfer
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.keys import KVLayout, Namespace

url = sys.argv[1]
# layer l1's storage is released (as vLLM's sleep mode does to the KV cache): placing into it fails
released = torch.zeros(4, 64, dtype=torch.uint8)
layers = {"l0": torch.zeros(4, 64, dtype=torch.uint8), "l1": released}
paged = PagedBlocks(layers, ["l0", "l1"], num_blocks=4)
ns = Namespace(KVLayout("test/placement", 2, 1, 32, "uint8", 1, block_bytes=paged.block_bytes))
handle = NamespaceHandle(ns, url=url)
hashes = [bytes([i]) * 16 for i in (1, 2)]
assert handle.put(hashes, [bytes([7]) * paged.block_bytes] * 2)
job = LoadJob([BlockTransfer("r", [0, 1], hashes)], paged)
job.fetch(handle)
released.untyped_storage().resize_(0)
fetched = sorted(job.block_ids[i] for i in job.good)
job.scatter()        # must not raise into the engine
print(json.dumps({"fetched": fetched, "bad": sorted(job.bad), "good": job.good,
                  "layer0_block0": int(layers["l0"][0, 0])}))
handle.close()

"""Run in the vLLM venv by tests/test_vllm_pd_admit.py: a consumer's scheduler half (``SchedulerSide``,
no engine) gets three hand-off requests whose named blocks are all in a real daemon, and is asked
for them pass after pass as vLLM's scheduler asks (each pass: every waiting request once, then
``build_connector_meta`` for the step).

    python vllm_pd_admit.py DAEMON_URL ADMIT_PER_STEP

The waits end together (the waiter finds every request's blocks at its first poll, before the
second pass). Prints one JSON line: the pass each request was let in at (its matched tokens), and
the counters.
"""

import json
import sys
import time
import types

import numpy as np

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.handoff import Handoff
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.scheduler_side import SchedulerSide
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import ChainHasher, KVLayout, Namespace
from prompt_request import PromptRequest

BLOCK = 16
BLOCKS = 4
LAYOUT = KVLayout(model="test/pd-admit", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=BLOCK)
url, admit = sys.argv[1], int(sys.argv[2])
NAMESPACE = Namespace(LAYOUT, cache_salt=f"pd-admit-{admit}")
HASHER = ChainHasher("xxh3_128", seed=0)


counts: dict[str, float] = {}


def count(key, n=1):
    counts[key] = counts.get(key, 0) + n


store = NamespaceHandle(NAMESPACE, url=url, timeout_s=5.0, name="store")
requests = []
for i in range(3):
    tokens = [int(t) for t in np.random.default_rng(i).integers(1, 30000, BLOCKS * BLOCK + 3)]
    hashes = HASHER.chain(tokens[:BLOCKS * BLOCK], BLOCK)
    assert store.put(hashes, [np.full(LAYOUT.block_bytes, i, dtype=np.uint8) for _ in hashes])
    params = Handoff(NAMESPACE.id, BLOCKS, BLOCK, hashes[-1], url).to_params()
    requests.append(PromptRequest(f"decode-{i}", tokens, params))

settings = ConnectorSettings(url=url, pd_admit_per_step=admit, lookup_timeout_s=5.0)
consumer = SchedulerSide(settings, Role.of("kv_consumer", settings), NAMESPACE, HASHER, BLOCK, [NAMESPACE],
                         lambda ns, timeout_s, what: NamespaceHandle(ns, url=url, timeout_s=timeout_s, name=what),
                         count)
empty_step = types.SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], preempted_req_ids=set(),
                                   scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                               resumed_req_ids=set(),
                                                                               num_computed_tokens=[]))
admitted: dict[str, int] = {}
matched: dict[str, int] = {}
for step in range(50):
    for r in requests:
        if r.request_id in admitted:
            continue
        n, _ = consumer.get_num_new_matched_tokens(r, 0)
        if n is not None:
            admitted[r.request_id], matched[r.request_id] = step, n
    consumer.build_connector_meta(empty_step)
    if len(admitted) == len(requests):
        break
    if step == 0:   # every wait has ended by the second pass
        deadline = time.monotonic() + 10
        while any(w.outcome is None for w in consumer._handoff_waits.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
consumer.shutdown()
store.close()
print(json.dumps({"admitted": admitted, "matched": matched, "counts": counts}))

"""Run in the vLLM venv by tests/test_vllm_pd_both.py: a ``kv_both`` engine's two connector halves
(``SchedulerSide`` and ``WorkerSide``, no engine; real paged KV tensors on the CPU) prefill a prompt
for a remote decode (``do_remote_decode``, as ``kvstore pd-proxy`` asks) against a real daemon.

    python vllm_both_handoff.py DAEMON_URL remote   # the request asks for a hand-off
    python vllm_both_handoff.py DAEMON_URL local    # an ordinary request (no hand-off)

The prompt is scheduled and computed in one step (its full blocks planned as saves and queued with
the worker's saver), the request finishes (``request_finished`` returns the params naming the
blocks), and the worker reports it in the next step (``get_finished``). That step runs as vLLM's CPU
worker runs it: the engine's thread keeps the GIL, with Python's forced switch put out of reach
(``sys.setswitchinterval``), so the saver's send thread gets it only where the engine's thread
blocks. Prints one JSON line: the params' blocks, how many of the named blocks the saver had
stored when ``get_finished`` returned (read before anything else can let the send thread run), and
how many the daemon holds once the saver is drained.
"""

import json
import os
import sys
import types

import numpy as np
import torch

from kvstore.client import CircuitBreaker, NamespaceHandle
from kvstore.connectors.vllm.handoff import Handoff
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.scheduler_side import SchedulerSide
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.connectors.vllm.worker_side import WorkerSide
from kvstore.keys import ChainHasher, KVLayout, Namespace
from prompt_request import PromptRequest

BLOCK = 16
LAYERS, HEADS, DIM = 4, 4, 64
NUM_BLOCKS = 64
LAYOUT = KVLayout(model="test/both-handoff", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16",
                  block_tokens=BLOCK)
PROMPT_BLOCKS = 12
url, case = sys.argv[1], sys.argv[2]
NAMESPACE = Namespace(LAYOUT, cache_salt=f"both-handoff-{case}")
HASHER = ChainHasher("xxh3_128", seed=0)


def handle(name: str, timeout_s: float = 5.0) -> NamespaceHandle:
    return NamespaceHandle(NAMESPACE, url=url, timeout_s=timeout_s,
                           breaker=CircuitBreaker(failures_to_open=1, cool_down_s=5.0), name=name)


counts: dict[str, float] = {}


def count(key, n=1):
    counts[key] = counts.get(key, 0) + n


settings = ConnectorSettings(url=url)
role = Role.of("kv_both", settings)
scheduler = SchedulerSide(settings, role, NAMESPACE, HASHER, BLOCK, [NAMESPACE],
                          lambda ns, timeout_s, what: handle(f"scheduler ({what})", timeout_s), count)
kv_cache_config = types.SimpleNamespace(num_blocks=NUM_BLOCKS,
                                        kv_cache_groups=[types.SimpleNamespace(layer_names=[f"l{i}" for i in range(LAYERS)])])
worker = WorkerSide(settings, role, NAMESPACE, 0, kv_cache_config,
                    lambda ns, timeout_s, what: handle(f"worker ({what})", timeout_s), count)
g = torch.Generator().manual_seed(38)
caches = {f"l{i}": torch.randint(-2**15, 2**15, (NUM_BLOCKS, 2, BLOCK, HEADS, DIM), generator=g,
                                 dtype=torch.int16).view(torch.bfloat16) for i in range(LAYERS)}
worker.register_kv_caches(caches)
assert worker._saver is not None, "the worker has no saver"

tokens = [int(t) for t in np.random.default_rng(7).integers(1, 30000, PROMPT_BLOCKS * BLOCK + 5)]
params = {"do_remote_decode": True, "do_remote_prefill": False} if case == "remote" else None
request = PromptRequest("prefill", tokens, params)
block_ids = list(range(3, 3 + PROMPT_BLOCKS + 1))

# step 1: the prompt is scheduled whole (nothing in the daemon yet) and computed
matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
assert matched == 0, matched
scheduler.update_state_after_alloc(request, types.SimpleNamespace(get_block_ids=lambda: [block_ids]), 0)
output = types.SimpleNamespace(
    num_scheduled_tokens={request.request_id: len(tokens)},
    scheduled_new_reqs=[types.SimpleNamespace(req_id=request.request_id, block_ids=[block_ids], num_computed_tokens=0)],
    scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                num_computed_tokens=[]),
    preempted_req_ids=set())
meta = scheduler.build_connector_meta(output)
assert [len(t.hashes) for t in meta.saves] == [PROMPT_BLOCKS], meta.saves
switch = sys.getswitchinterval()
sys.setswitchinterval(1000.0)       # the engine's thread keeps the GIL from here on
try:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    # the request finished in that step: the scheduler names its blocks (asked for a hand-off)
    held, out_params = scheduler.request_finished(request, block_ids)
    # step 2: the worker reports the finished request
    sending, _ = worker.get_finished({request.request_id})
    stored_at_report = counts.get("saved_blocks", 0)
finally:
    sys.setswitchinterval(switch)
worker.drain_saves(30.0)
named = Handoff.from_params(out_params).blocks if out_params else 0
hashes = HASHER.chain(tokens[:PROMPT_BLOCKS * BLOCK], BLOCK)
check = handle("check")
in_daemon = check.lookup(hashes, lease=False).num_hit
scheduler.shutdown()
worker.shutdown()
check.close()
print(json.dumps({"held": held, "sending": sorted(sending or ()), "named": named, "stored_at_report": stored_at_report,
                  "in_daemon": in_daemon, "counts": counts}))
# the result is out: skip the interpreter's teardown of the engine's native threads, which can
# abort ("terminate called without an active exception") on a loaded host after the work is done
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

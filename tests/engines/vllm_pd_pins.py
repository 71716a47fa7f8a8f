"""Run in the vLLM venv by tests/test_vllm_pd_pins.py: the connector's scheduler halves
(``SchedulerSide`` as ``kv_producer`` and ``kv_consumer``, no engine) hand a prompt off through a
real daemon while a flood of puts evicts what its small CPU and NVMe tiers hold.

    python vllm_pd_pins.py DAEMON_URL after     # the flood comes after the hand-off
    python vllm_pd_pins.py DAEMON_URL before    # the flood comes between arrival and hand-off
    python vllm_pd_pins.py DAEMON_URL deleted   # no flood: the last held block is deleted before
                                                # the hand-off
    python vllm_pd_pins.py DAEMON_URL late      # the params also name a block still being saved:
                                                # the flood comes while the consumer waits for it,
                                                # after the producer's lease ran out, then it lands

The prompt's HELD full blocks are in the daemon before the prefill arrives (another request stored
them), so the producer names them without saving them. A control chain, stored too and never
named, shows the flood evicts what nobody pinned. Prints one JSON line: the params' blocks and
unsaved counts, how many prompt and control blocks the daemon holds after the flood, the
consumer's matched tokens, its seconds deferred, and both halves' counters. The requests are
``prompt_request.PromptRequest``s: the fields the scheduler half reads from vLLM's ``Request``.
"""

import json
import sys
import time

import numpy as np

from kvstore.client import CircuitBreaker, NamespaceHandle
from kvstore.connectors.vllm.handoff import Handoff
from kvstore.connectors.vllm.roles import Role
from kvstore.connectors.vllm.scheduler_side import SchedulerSide
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import ChainHasher, KVLayout, Namespace
from prompt_request import PromptRequest

BLOCK = 16
LAYOUT = KVLayout(model="test/pd-pins", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                  block_tokens=BLOCK)          # 128 KiB blocks
NAMESPACE = Namespace(LAYOUT, cache_salt="pd-pins")
HELD = 4
FLOOD = 200          # blocks: well over what the test's 4 MiB CPU arena and 4 MiB NVMe tier hold
HASHER = ChainHasher("xxh3_128", seed=0)
url, case, pd_wait_s, lease_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])


def payloads(hashes):
    return [np.frombuffer((h * (LAYOUT.block_bytes // len(h) + 1))[:LAYOUT.block_bytes], dtype=np.uint8)
            for h in hashes]


def handle(name: str, timeout_s: float = 5.0) -> NamespaceHandle:
    return NamespaceHandle(NAMESPACE, url=url, timeout_s=timeout_s,
                           breaker=CircuitBreaker(failures_to_open=1, cool_down_s=5.0), name=name)


def side(role: str, counts: dict) -> SchedulerSide:
    settings = ConnectorSettings(url=url, pd_wait_s=pd_wait_s, lookup_timeout_s=5.0)

    def count(key, n=1):
        counts[key] = counts.get(key, 0) + n

    return SchedulerSide(settings, Role.of(role, settings), NAMESPACE, HASHER, BLOCK, [NAMESPACE],
                         lambda ns, timeout_s, what: handle(f"{role} ({what})", timeout_s), count)


def held_prompt(store: NamespaceHandle, seed: int, more: int = 0):
    """A prompt of HELD + ``more`` full blocks and a few tokens, whose first HELD the daemon holds."""
    tokens = [int(t) for t in np.random.default_rng(seed).integers(1, 30000, (HELD + more) * BLOCK + 5)]
    hashes = HASHER.chain(tokens[:(HELD + more) * BLOCK], BLOCK)
    assert store.put(hashes[:HELD], payloads(hashes[:HELD]))
    return tokens, hashes


def flood(store: NamespaceHandle) -> None:
    hashes = HASHER.chain(np.arange(FLOOD * BLOCK) + 40000, BLOCK)
    for a in range(0, FLOOD, 8):
        store.put(hashes[a:a + 8], payloads(hashes[a:a + 8]), parent=hashes[a - 1] if a else None)


store = handle("store")
tokens, hashes = held_prompt(store, 1, more=int(case == "late"))
_, control = held_prompt(store, 2)
pc, cc = {}, {}
producer, consumer = side("kv_producer", pc), side("kv_consumer", cc)
prefill = PromptRequest("prefill", tokens)
assert producer.get_num_new_matched_tokens(prefill, 0) == (0, False)   # a producer never loads
if case == "before":
    flood(store)
if case == "deleted":
    assert store.delete(hashes[HELD - 1:HELD]) == 1
_, params = producer.request_finished(prefill, [])
if case == "after":
    flood(store)
if case == "late":   # as if the prefill saved the last block: named, still on its way
    params = Handoff(NAMESPACE.id, HELD + 1, BLOCK, hashes[HELD], url).to_params()
    assert consumer.get_num_new_matched_tokens(PromptRequest("decode", tokens, params), 0)[0] is None   # it waits
    time.sleep(lease_s + 0.5)       # the producer's lease ran out
    flood(store)
    control_left = store.lookup(control, lease=False).num_hit
    assert store.put(hashes[HELD:], payloads(hashes[HELD:]), parent=hashes[HELD - 1])   # the save lands
left = store.lookup(hashes, lease=False).num_hit
if case != "late":
    control_left = store.lookup(control, lease=False).num_hit
handoff = Handoff.from_params(params)

decode, t0 = PromptRequest("decode", tokens, params), time.monotonic()
while True:     # vLLM asks again every pass while the request is deferred
    matched, _ = consumer.get_num_new_matched_tokens(decode, 0)
    if matched is not None:
        break
    assert time.monotonic() - t0 < pd_wait_s + 30, "deferred past pd_wait_s"
    time.sleep(0.01)
deferred_s = time.monotonic() - t0
producer.shutdown()
consumer.shutdown()
store.close()
print(json.dumps({"blocks": handoff.blocks, "unsaved": handoff.unsaved, "left": left, "control_left": control_left,
                  "matched": matched, "deferred_s": deferred_s, "producer": pc, "consumer": cc}))

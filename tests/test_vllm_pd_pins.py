"""A producer's hand-off pins the blocks it names (tests/engines/vllm_pd_pins.py, in the vLLM venv:
the connector's scheduler halves, no engine, against a real daemon whose 4 MiB CPU arena and 4 MiB
NVMe tier a flood of 200 blocks of 128 KiB overfills).

A producer names to decode the prompt blocks its daemon already held when the prompt arrived.
Its arrival lookup takes no lease; without a pin at the hand-off, a flood between the hand-off and
the consumer's lookup evicts them and the consumer waits ``pd_wait_s`` for blocks that are gone.
Each flood case checks that the flood did evict an unpinned control chain, so it tells the two apart.
"""

from __future__ import annotations

import vllm_runner

HELD = 4
BLOCK = 16
PD_WAIT_S = 5.0


def run(daemon_factory, case: str, lease_s: float = 60.0, pd_wait_s: float = PD_WAIT_S) -> dict:
    # a long lease by default, so the flood's own duration on a loaded host is not what is tested
    d = daemon_factory("--lease-seconds", str(lease_s), cpu_bytes="4MiB", nvme_bytes="4MiB")
    r, _ = vllm_runner.run_script("vllm_pd_pins.py", d.url, case, str(pd_wait_s), str(lease_s))
    assert r["producer"]["pd_held_blocks"] == HELD
    assert case == "deleted" or r["control_left"] < HELD, f"the flood evicted nothing unpinned: {r}"
    return r


def test_blocks_named_at_hand_off_survive_a_flood_and_load_without_waiting(daemon_factory):
    r = run(daemon_factory, "after")
    assert (r["blocks"], r["unsaved"]) == (HELD, 0), r
    assert r["left"] == HELD, r                         # pinned from the hand-off on
    assert r["matched"] == HELD * BLOCK, r
    assert r["consumer"].get("pd_loaded_blocks") == HELD and "pd_recomputes" not in r["consumer"], r


def test_blocks_evicted_before_hand_off_are_named_unsaved_and_not_waited_for(daemon_factory):
    r = run(daemon_factory, "before")
    left = r["left"]
    assert left < HELD, r
    assert (r["blocks"], r["unsaved"]) == (left, HELD - left), r
    assert r["producer"]["pd_evicted_blocks"] == HELD - left == r["producer"]["pd_unsaved_blocks"], r
    assert r["matched"] == left * BLOCK, r
    c = r["consumer"]
    assert c.get("pd_recomputes_unsaved") == 1 and "pd_recomputes_timeout" not in c, r
    assert c["pd_recomputed_blocks"] == HELD - left, r
    assert r["deferred_s"] < PD_WAIT_S, r


def test_params_naming_some_blocks_and_some_unsaved_load_those_and_recompute_the_rest_at_once(daemon_factory):
    """The last held block is gone by the hand-off: the params name the three before it and mark
    one unsaved; the consumer loads the three and does not wait for the fourth."""
    r = run(daemon_factory, "deleted")
    assert (r["blocks"], r["unsaved"], r["left"]) == (HELD - 1, 1, HELD - 1), r
    assert r["producer"]["pd_evicted_blocks"] == 1, r
    assert r["matched"] == (HELD - 1) * BLOCK, r
    c = r["consumer"]
    assert c.get("pd_loaded_blocks") == HELD - 1 and c.get("pd_recomputes_unsaved") == 1, r
    assert c["pd_recomputed_blocks"] == 1 and "pd_recomputes_timeout" not in c, r
    assert r["deferred_s"] < PD_WAIT_S, r


def test_a_waiting_consumer_keeps_the_named_blocks_pinned_past_the_producers_lease(daemon_factory):
    """The params name one block more, still being saved; the consumer waits for it. Its polls are
    leased lookups, so the blocks already there outlive the producer's 1 s lease and a flood, and
    all load once the last one lands."""
    r = run(daemon_factory, "late", lease_s=1.0, pd_wait_s=30.0)
    assert r["left"] == HELD + 1, r
    assert r["matched"] == (HELD + 1) * BLOCK, r
    assert r["consumer"].get("pd_loaded_blocks") == HELD + 1 and "pd_recomputes" not in r["consumer"], r

"""A consumer lets at most ``pd_admit_per_step`` hand-off requests into one engine step
(tests/engines/vllm_pd_admit.py, in the vLLM venv: the consumer's scheduler half, no engine, a real
daemon holding every named block).

Each admitted request's load and prompt tail lengthen the step it joins, which every request already
decoding waits for; a prefill engine that batched several prompts hands them off together.
"""

from __future__ import annotations

import vllm_runner

BLOCK = 16


def _admitted(daemon_factory, admit_per_step: int) -> dict:
    d = daemon_factory()
    r, _ = vllm_runner.run_script("vllm_pd_admit.py", d.url, str(admit_per_step))
    assert set(r["matched"].values()) == {4 * BLOCK}, r      # every named block loads
    assert r["counts"].get("pd_loaded_requests") == 3 and "pd_recomputes" not in r["counts"], r
    return r


def test_a_consumer_lets_one_hand_off_into_each_engine_step(daemon_factory):
    """Three hand-offs whose blocks are all there at once (a prefill engine that batched their
    prompts) go into three consecutive steps, not one: each one's load and prompt tail lengthen
    its step, which every running request waits for (decode ITL)."""
    r = _admitted(daemon_factory, 1)
    assert sorted(r["admitted"].values()) == [1, 2, 3], r
    assert r["counts"].get("pd_admit_deferrals") == 3, r       # two held at pass 1, one at pass 2


def test_with_no_admission_limit_every_ready_hand_off_goes_into_the_same_step(daemon_factory):
    r = _admitted(daemon_factory, 0)
    assert sorted(r["admitted"].values()) == [1, 1, 1], r
    assert "pd_admit_deferrals" not in r["counts"], r

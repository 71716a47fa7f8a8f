"""A ``kv_both`` engine that prefills for a remote decode (``do_remote_decode``) stands behind its
hand-off params as a producer does (tests/engines/vllm_both_handoff.py, in the vLLM venv: both
connector halves, no engine, a real daemon).

vLLM's CPU worker keeps the GIL while it steps, so a put queued as the prefill finished can wait
for the engine's next real step; a decode engine handed the params meanwhile waits for blocks that
are not sent. A producer's worker therefore waits, as the request is reported, for its put
(``saver.SEND_WAIT_S``); a ``kv_both`` request that hands off must too, and one that does not must
not pay for it.
"""

from __future__ import annotations

import vllm_runner

PROMPT_BLOCKS = 12


def test_a_kv_both_hand_off_is_in_the_daemon_when_the_request_is_reported(daemon_factory):
    d = daemon_factory()
    r, _ = vllm_runner.run_script("vllm_both_handoff.py", d.url, "remote")
    assert r["held"] is True and r["sending"] == ["prefill"], r
    assert r["named"] == PROMPT_BLOCKS, r
    assert r["stored_at_report"] == PROMPT_BLOCKS, f"the named blocks were not stored when reported: {r}"
    assert r["in_daemon"] == PROMPT_BLOCKS, r


def test_a_kv_both_request_without_hand_off_names_nothing_and_still_saves(daemon_factory):
    d = daemon_factory()
    r, _ = vllm_runner.run_script("vllm_both_handoff.py", d.url, "local")
    assert r["named"] == 0 and r["sending"] == ["prefill"], r
    assert r["in_daemon"] == PROMPT_BLOCKS, r     # saved in the background, not waited for

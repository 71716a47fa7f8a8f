"""A prompt whose prefix another request of the same engine is computing (issue 34: serving at
busy request rates): on a real vLLM CPU engine with a real daemon and vLLM's own prefix cache off,
two prompts sharing a 6-block prefix arrive together; the step budget fits both, so the second
is looked up while the first is scheduled and before any of its blocks is computed. With
``inflight_wait_s`` it waits for the first's saves and loads the prefix; with 0 it computes the
prefix a second time, in the same step. Either way both get the same tokens as a cold engine.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402

pytestmark = pytest.mark.timeout(900)
BLOCK = 32
tok = vllm_runner.prompt_tokens(20261205)
PREFIX = tok(6 * BLOCK)
FIRST, SECOND = PREFIX + tok(8), PREFIX + tok(8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from daemon_util import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("kvd"))
    model = vllm_runner.tiny_model(tmp_path_factory)
    steps = [{"serve": [FIRST, SECOND], "max_tokens": 4}]

    def job(name: str, connector: bool = True, **extra) -> tuple[str, dict]:
        engine = {"model": model["out_dir"], "max_model_len": 1024, "kv_cache_memory_bytes": 32 * 2**20,
                  "max_num_batched_tokens": 512, "enable_chunked_prefill": True}
        spec = {"build": model, "engine": engine, "steps": steps}
        if connector:   # a namespace per job: nothing one stored is found by another
            spec["kv_transfer_config"] = vllm_runner.kvstore_transfer_config(
                f"grpc://{d.url}", retry_after_s=30, cache_salt=name, **extra)
        return name, spec

    try:
        return dict(zip(("waits", "no_wait", "cold"), vllm_runner.run_jobs(
            vllm_runner.vllm_python(), str(tmp_path_factory.mktemp("vllm")),
            [job("waits"), job("no_wait", inflight_wait_s=0), job("cold", connector=False)], timeout_s=600)))
    finally:
        d.kill()


def test_the_second_prompt_waits_for_the_first_ones_prefix_and_loads_it(runs):
    waits = runs["waits"]
    assert waits["steps"][0]["num_cached_tokens"] == [0, len(PREFIX)]   # loaded from the daemon
    sched = waits["connector"]["scheduler"]
    assert sched["inflight_waits"] == 1 and sched["inflight_arrived"] == 1, sched
    assert waits["steps"][0]["outputs"] == runs["cold"]["steps"][0]["outputs"]


def test_without_the_wait_the_second_prompt_computes_the_prefix_again(runs):
    no_wait = runs["no_wait"]
    assert no_wait["steps"][0]["num_cached_tokens"] == [0, 0]
    assert "inflight_waits" not in no_wait["connector"]["scheduler"]
    assert no_wait["steps"][0]["outputs"] == runs["cold"]["steps"][0]["outputs"]

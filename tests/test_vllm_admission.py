"""Cache-aware admission (issue 13: hit TTFT): on a real vLLM CPU engine with a real daemon, a hit
that arrives behind two cold prompts gets its first token before them with
``kvstore.connectors.vllm.admission`` and after the first of them without it (first come, first
served). The step budget fits one cold prompt, so the order is the engine's, not the clock's.
With the daemon down, every request is admitted as a miss and served.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402

pytestmark = pytest.mark.timeout(900)
BLOCK = 32
tok = vllm_runner.prompt_tokens(20261202)
PREFIX = tok(6 * BLOCK)
SEED, COLD_A, COLD_B, HIT = PREFIX + tok(8), tok(200), tok(200), PREFIX + tok(8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from daemon_util import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("kvd"))
    model = vllm_runner.tiny_model(tmp_path_factory)
    steps = [{"generate": [SEED], "max_tokens": 1}, {"drain": True},
             {"serve": [COLD_A, COLD_B, HIT], "max_tokens": 4}]

    def job(name: str, url: str = d.url, **scheduling) -> tuple[str, dict]:
        engine = {"model": model["out_dir"], "max_model_len": 1024, "kv_cache_memory_bytes": 32 * 2**20,
                  "max_num_batched_tokens": 200, "enable_chunked_prefill": True, **scheduling}
        return name, {"build": model, "engine": engine, "steps": steps,
                      "kv_transfer_config": vllm_runner.kvstore_transfer_config(   # a namespace per job
                          f"grpc://{url}", retry_after_s=30, cache_salt=name)}

    aware_async = {"scheduling_policy": "priority",
                   "scheduler_cls": "kvstore.connectors.vllm.admission.CacheAwareAsyncScheduler"}
    with socket.socket() as s:   # a port nobody listens on: the daemon is down
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        return dict(zip(("fcfs", "async", "sync", "down"), vllm_runner.run_jobs(
            vllm_runner.vllm_python(), str(tmp_path_factory.mktemp("vllm")), [
                job("fcfs"),
                job("async", **aware_async),
                job("sync", scheduling_policy="priority", async_scheduling=False,
                    scheduler_cls="kvstore.connectors.vllm.admission.CacheAwareScheduler"),
                job("down", url=nobody, **aware_async)], timeout_s=600)))
    finally:
        d.kill()


@pytest.mark.parametrize("scheduling, cls", [("async", "CacheAwareAsyncScheduler"), ("sync", "CacheAwareScheduler")])
def test_a_hit_behind_cold_prompts_gets_its_first_token_first(runs, scheduling, cls):
    aware = runs[scheduling]
    assert aware["scheduler"] == {"class": cls, "policy": "priority"}
    a, b, hit = aware["steps"][2]["ttft"]
    assert hit < a < b
    assert aware["steps"][2]["num_cached_tokens"][2] == len(PREFIX)   # loaded from the daemon
    assert aware["connector"]["scheduler"]["admitted_hits"] == 1
    assert aware["connector"]["scheduler"]["admitted_misses"] == 3    # the seed and the two cold prompts


def test_first_come_first_served_keeps_the_hit_behind(runs):
    fcfs = runs["fcfs"]
    a, b, hit = fcfs["steps"][2]["ttft"]
    assert a < hit
    assert fcfs["steps"][2]["num_cached_tokens"][2] == len(PREFIX)
    assert "admitted_hits" not in fcfs["connector"]["scheduler"]


def test_with_the_daemon_down_every_request_is_served_as_a_miss(runs):
    down = runs["down"]
    assert down["scheduler"]["class"] == "CacheAwareAsyncScheduler"
    assert [len(o) for o in down["steps"][2]["outputs"]] == [4, 4, 4]
    assert down["steps"][2]["num_cached_tokens"] == [0, 0, 0]
    assert down["connector"]["scheduler"]["admitted_misses"] == 4 and "admitted_hits" not in down["connector"]["scheduler"]

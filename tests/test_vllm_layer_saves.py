"""Per-layer saves (issue 13 item 2, ``save_mode: layer``): on a real vLLM CPU engine each layer's
pages of the step's saved blocks are copied out by ``save_kv_layer`` as the forward pass computes
them. The blocks the daemon then holds are byte for byte those the after-the-step copy stores
(``save_mode: step``, the same prompts under another namespace salt), a fresh engine loading them
generates the same tokens, and decode blocks saved at a request's end arrive the same way.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from kvstore.keys import ChainHasher, Namespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402

pytestmark = pytest.mark.timeout(900)
BLOCK = 32
tok = vllm_runner.prompt_tokens(20261203)
A, B = tok(200), tok(150)          # 6 and 4 full prompt blocks
MAX_TOKENS = 50                    # B's answer fills blocks 4 and 5 (decode saves)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from daemon_util import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("kvd"))
    model = vllm_runner.tiny_model(tmp_path_factory)
    work = str(tmp_path_factory.mktemp("vllm"))
    gen = {"generate": [A, B], "max_tokens": MAX_TOKENS}

    def job(name: str, salt: str, steps: list, **extra) -> tuple[str, dict]:
        engine = {"model": model["out_dir"], "max_model_len": 1024, "kv_cache_memory_bytes": 32 * 2**20}
        return name, {"build": model, "engine": engine, "steps": steps,
                      "kv_transfer_config": vllm_runner.kvstore_transfer_config(
                          f"grpc://{d.url}", retry_after_s=30, cache_salt=salt, **extra)}

    try:
        python = vllm_runner.vllm_python()
        step, layer = vllm_runner.run_jobs(python, work, [
            job("step", "step", [gen, {"drain": True}], save_mode="step"),
            job("layer", "layer", [gen, {"drain": True}], save_mode="layer")], timeout_s=600)
        (reload,) = vllm_runner.run_jobs(python, work, [job("reload", "layer", [gen], save=False)], timeout_s=600)
        with d.client() as c:
            stored = {}
            for name, result in (("step", step), ("layer", layer)):
                ns = c.register_namespace(Namespace.from_dict(result["connector"]["namespace"]))
                stored[name] = {}
                for prompt, out in zip((A, B), result["steps"][0]["outputs"]):
                    hashes = ChainHasher("xxh3_128", seed=0).chain((prompt + out)[:-1], BLOCK)
                    stored[name].update(zip(hashes, c.get(ns, hashes)))
    finally:
        d.kill()
    return {"step": step, "layer": layer, "reload": reload, "stored": stored}


def test_layer_saves_store_the_bytes_the_after_step_copy_stores(runs):
    step, layer = runs["stored"]["step"], runs["stored"]["layer"]
    assert runs["layer"]["connector"]["worker"]["layer_saved_blocks"] >= 6 + 4
    assert "layer_saved_blocks" not in runs["step"]["connector"]["worker"]
    assert step.keys() == layer.keys() and len(step) == 7 + 6   # prompt and decode blocks of A and B
    assert all(v is not None for v in step.values())
    assert all(np.array_equal(np.frombuffer(layer[h], np.uint8), np.frombuffer(step[h], np.uint8)) for h in step)


def test_a_fresh_engine_loading_layer_saved_blocks_generates_the_same_tokens(runs):
    assert runs["reload"]["steps"][0]["outputs"] == runs["layer"]["steps"][0]["outputs"]
    assert runs["reload"]["steps"][0]["num_cached_tokens"] == [6 * BLOCK, 4 * BLOCK]

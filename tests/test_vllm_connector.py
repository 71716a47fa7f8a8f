"""The vLLM connector end to end: real vLLM engines (CPU build, own venv), a real daemon, a tiny
random Llama built on the fly.

Engines run as subprocesses of the vLLM venv's python (``KVSTORE_VENV_VLLM``, set by
scripts/test.sh; built here through scripts/engine-venv.sh when missing) driving
tests/engines/vllm_driver.py. Engine starts are the cost, so the scenario is three phases of at
most two engines each, run in parallel within a phase, shared by the tests below:

1. ``baseline`` (no connector) || ``first`` (connector, vLLM prefix caching ON, saves to the daemon)
2. ``second`` (fresh process, empty local cache, prefix caching OFF: everything must come from the
   daemon) || ``other_model`` (a different model and layout against the same daemon)
3. the stored KV of prompt A is overwritten with other bytes of the same size through the client,
   then ``third`` loads it (outputs must change); the daemon loses D's blocks between lookup and
   load (fault injection in the driver: the load fails, vLLM recomputes); the daemon is SIGKILLed
   and more requests run.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from kvstore.keys import ChainHasher, Namespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402
BLOCK = 32
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(1500)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(20261129)
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    a = tok(200)                      # 6 full blocks
    return {"A": a,
            "B": a[:160] + tok(50),   # shares 5 blocks with A
            "C": tok(150),            # unrelated, 4 full blocks
            "D": a[:96] + tok(70)}    # shares 3 blocks with A


PROMPTS = _prompts()


class Engines:
    """Builds driver jobs for the tiny models and runs them (tests/engines/vllm_runner.py)."""

    def __init__(self, python: str, workdir) -> None:
        self.python = python
        self.workdir = str(workdir)

    def job(self, name: str, model: dict, steps: list, url: str | None = None, prefix_caching: bool = False,
            extra: dict | None = None) -> tuple[str, dict]:
        job = {"build": model, "engine": {"model": model["out_dir"], "enable_prefix_caching": prefix_caching,
                                          "max_model_len": 1024, "kv_cache_memory_bytes": 32 * 2**20},
               "steps": steps}
        if url is not None:
            job["kv_transfer_config"] = vllm_runner.kvstore_transfer_config(f"grpc://{url}", retry_after_s=30,
                                                                             **(extra or {}))
        return name, job

    def run(self, *jobs: tuple[str, dict]) -> list[dict]:
        return vllm_runner.run_jobs(self.python, self.workdir, list(jobs), timeout_s=600)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Engines:
    return Engines(vllm_runner.vllm_python(), tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("models")
    return {"tiny": {"out_dir": str(root / "tiny"), "layers": 2, "seed": 0},
            # another model: other weights and another layout (3 layers)
            "other": {"out_dir": str(root / "other"), "layers": 3, "seed": 1}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from daemon_util import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("kvd"))
    yield d
    d.kill()


def _gen(*names: str) -> dict:
    return {"generate": [PROMPTS[n] for n in names], "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def phase1(engines, models, daemon):
    baseline, first = engines.run(
        engines.job("baseline", models["tiny"], [_gen("A", "B", "C", "D")]),
        engines.job("first", models["tiny"], [_gen("A", "C"), {"drain": True}, _gen("B", "D", "A")],
                    url=daemon.url, prefix_caching=True))
    base = dict(zip("ABCD", baseline["steps"][0]["outputs"]))
    return {"baseline": base, "first": first}


@pytest.fixture(scope="module")
def phase2(engines, models, daemon, phase1):
    second, other = engines.run(
        engines.job("second", models["tiny"], [_gen("A", "B", "C", "D")], url=daemon.url),
        engines.job("other", models["other"], [_gen("A", "B")], url=daemon.url))
    return {"second": second, "other": other}


def _namespace_id(client, result: dict) -> bytes:
    return client.register_namespace(Namespace.from_dict(result["connector"]["namespace"]))


@pytest.fixture(scope="module")
def phase3(engines, models, daemon, phase2):
    """Overwrite A's stored blocks with C's bytes, load them, then kill the daemon mid-run."""
    hasher = ChainHasher("xxh3_128", seed=0)
    with daemon.client() as c:
        ns = _namespace_id(c, phase2["second"])
        a_hashes = hasher.chain(PROMPTS["A"], BLOCK)[:4]
        c_blocks = c.get(ns, hasher.chain(PROMPTS["C"], BLOCK)[:4])
        assert all(b is not None for b in c_blocks)
        old = c.get(ns, a_hashes)
        assert all(b is not None for b in old) and all(x != y for x, y in zip(old, c_blocks))
        assert c.delete(ns, a_hashes) == 4
        c.put(ns, a_hashes, c_blocks)
        assert c.get(ns, a_hashes) == c_blocks
    (third,) = engines.run(engines.job("third", models["tiny"], [
        _gen("A"),                                  # loads the overwritten blocks
        {**_gen("D"), "lose_after_lookup": True},   # the daemon loses D's blocks between lookup and load
        {"kill": daemon.pid},
        _gen("B", "C")], url=daemon.url))
    return {"third": third}


# ---------------------------------------------------------------------------------------------

def test_outputs_with_connector_identical_prefix_caching_on(phase1):
    first = phase1["first"]
    base = phase1["baseline"]
    outs = first["steps"][0]["outputs"] + first["steps"][2]["outputs"]
    assert outs == [base[k] for k in ("A", "C", "B", "D", "A")]
    assert all(len(o) == MAX_TOKENS for o in outs)
    # step 1 found an empty daemon; in step 3 the daemon held B's first 5, D's first 3 and all of
    # A's 6 blocks, but vLLM's own prefix cache answered first, so nothing was loaded
    assert first["connector"]["scheduler"]["lookup_hit_blocks"] == 5 + 3 + 6
    assert first["connector"]["worker"].get("loaded_blocks", 0) == 0
    # every full prompt block computed and not yet in the daemon was saved, once
    assert first["connector"]["worker"]["saved_blocks"] == 6 + 4 + 1 + 2  # A, C, B's 6th, D's 4th and 5th
    assert first["connector"]["worker"].get("save_failed_blocks", 0) == 0


def test_fresh_engine_loads_shared_prefix_from_daemon(phase1, phase2):
    second = phase2["second"]
    step = second["steps"][0]
    assert step["outputs"] == [phase1["baseline"][k] for k in "ABCD"]
    # prefix caching is off: every cached token came through the connector
    assert step["num_cached_tokens"] == [192, 192, 128, 160]
    w = second["connector"]["worker"]
    assert w["loaded_blocks"] == 6 + 6 + 4 + 5 and w.get("load_failed_blocks", 0) == 0


def test_blocks_are_stored_under_the_documented_chain_hashes(phase2, daemon):
    hasher = ChainHasher("xxh3_128", seed=0)
    with daemon.client() as c:
        ns = _namespace_id(c, phase2["second"])
        assert ns.hex() == phase2["second"]["connector"]["namespace_id"]
        assert all(c.exists(ns, hasher.chain(PROMPTS["A"], BLOCK)))
        layout = phase2["second"]["connector"]["namespace"]["layout"]
        assert layout["layout"] == "vllm_cpu" and layout["block_tokens"] == BLOCK
        assert layout["num_layers"] == 2 and layout["dtype"] == "bfloat16"
        assert layout["block_bytes"] == 2 * 2 * BLOCK * layout["num_kv_heads"] * layout["head_dim"] * 2


def test_other_model_never_shares_blocks(phase2, daemon):
    other, second = phase2["other"], phase2["second"]
    assert other["connector"]["namespace_id"] != second["connector"]["namespace_id"]
    assert other["connector"]["namespace"]["layout"]["num_layers"] == 3
    assert other["steps"][0]["num_cached_tokens"] == [0, 0]
    assert other["connector"]["scheduler"]["lookup_hit_blocks"] == 0
    assert other["connector"]["worker"].get("loaded_blocks", 0) == 0
    # each model's blocks live in its own namespace, with its own size
    hasher = ChainHasher("xxh3_128", seed=0)
    with daemon.client() as c:
        ns_other = _namespace_id(c, other)
        a = hasher.chain(PROMPTS["A"], BLOCK)
        assert all(c.exists(ns_other, a))
        assert len(c.get(ns_other, a[:1])[0]) == other["connector"]["namespace"]["layout"]["block_bytes"]
        assert not any(c.exists(ns_other, hasher.chain(PROMPTS["C"], BLOCK)))


def test_loaded_kv_is_used_corrupt_blocks_change_output(phase1, phase3):
    step = phase3["third"]["steps"][0]
    assert step["num_cached_tokens"] == [192]
    assert step["outputs"][0] != phase1["baseline"]["A"]


def test_failed_load_is_reported_and_recomputed(phase1, phase3):
    third = phase3["third"]
    step = third["steps"][1]
    # the lookup promised D's 5 blocks; the load found none, said so, and vLLM recomputed
    assert third["connector"]["scheduler"]["load_planned_blocks"] == 6 + 5
    assert third["connector"]["worker"]["load_failed_blocks"] == 5
    assert third["connector"]["worker"]["loaded_blocks"] == 6
    assert step["outputs"] == [phase1["baseline"]["D"]]


def test_daemon_killed_mid_run_requests_still_complete(phase1, phase3):
    third = phase3["third"]
    after = third["steps"][3]
    assert after["outputs"] == [phase1["baseline"][k] for k in "BC"]
    assert after["num_cached_tokens"] == [0, 0]

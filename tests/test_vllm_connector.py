"""The vLLM connector end to end: real vLLM engines (CPU build, own venv), a real daemon, a tiny
random Llama built on the fly.

Engines run as subprocesses of the vLLM venv's python (``KVSTORE_VENV_VLLM``, set by
scripts/test.sh; built here through scripts/engine-venv.sh when missing) driving
tests/engines/vllm_driver.py. Engine starts are the cost, so the scenario is three phases of at
most two engines each, run in parallel within a phase, shared by the tests below:

1. ``baseline`` (no connector) || ``first`` (connector, vLLM prefix caching ON, saves to the daemon)
2. ``second`` (fresh process, empty local cache, prefix caching OFF: everything must come from the
   daemon; then turn 1 of a conversation, whose answer fills blocks) || ``other_model`` (a different
   model and layout against the same daemon)
2b. the same prompts in ``load_mode`` ``async`` and ``layer`` (fresh engines, in parallel): outputs
   identical to the baseline; turn 2 (turn 1 + its answer + a new message) hits through the answer;
   an async load whose blocks vanish before they arrive is recomputed
3. the stored KV of prompt A is overwritten with other bytes of the same size through the client,
   then ``third`` loads it (outputs must change); the daemon loses D's blocks between lookup and
   load (fault injection in the driver: the load fails, vLLM recomputes); the daemon is SIGKILLed
   and more requests run.
"""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm import identity
from kvstore.connectors.vllm.identity import checked_hasher, namespace_for
from kvstore.connectors.vllm.ranks import hits_on_every_rank, is_writer, lookup_namespaces
from kvstore.connectors.vllm.settings import LOAD_MODES, ConnectorSettings
from kvstore.errors import HashSelfCheckFailed
from kvstore.keys import ChainHasher, Namespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402
BLOCK = 32
MAX_TOKENS = 8
TURN1_ANSWER = 43      # 150 + 43 tokens: KV computed for 192 = 6 full blocks (the last token has none)

pytestmark = pytest.mark.timeout(1500)


def _prompts() -> dict[str, list[int]]:
    tok = vllm_runner.prompt_tokens(20261129)
    a = tok(200)                      # 6 full blocks
    return {"A": a,
            "B": a[:160] + tok(50),   # shares 5 blocks with A
            "C": tok(150),            # unrelated, 4 full blocks
            "D": a[:96] + tok(70),    # shares 3 blocks with A
            "T1": tok(150),           # turn 1 of a conversation; its 43-token answer fills blocks 4 and 5
            "E": tok(130),            # unrelated, 4 full blocks (async fault injection)
            "new_message": tok(20)}


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
    second_job = engines.job("second", models["tiny"], [_gen("A", "B", "C", "D"),
                                                        {"generate": [PROMPTS["T1"]], "max_tokens": TURN1_ANSWER}],
                             url=daemon.url)
    second_job[1]["metrics"] = True   # with vLLM's Prometheus stat logger on
    second, other = engines.run(
        second_job,
        # (B shares 5 blocks with A: with the in-flight wait it would load them from this model's own
        # namespace once A saved them; what this engine checks is that nothing comes from tiny's)
        engines.job("other", models["other"], [_gen("A", "B")], url=daemon.url, extra={"inflight_wait_s": 0}))
    return {"second": second, "other": other}


def _namespace_id(client, result: dict) -> bytes:
    return client.register_namespace(Namespace.from_dict(result["connector"]["namespace"]))


def _turn2(phase2) -> list[int]:
    answer = phase2["second"]["steps"][1]["outputs"][0]
    return PROMPTS["T1"] + answer + PROMPTS["new_message"]


@pytest.fixture(scope="module")
def modes(engines, models, daemon, phase2):
    """Fresh engines loading in async and layer mode; turn 2 of the conversation; lost async blocks."""
    turn2 = {"generate": [_turn2(phase2)], "max_tokens": MAX_TOKENS}
    async_, layer = engines.run(
        engines.job("async", models["tiny"], [_gen("A", "B", "C", "D"), turn2, _gen("E"), {"drain": True},
                                              {**_gen("E"), "lose_after_lookup": True}],
                    url=daemon.url, extra={"load_mode": "async"}),
        engines.job("layer", models["tiny"], [_gen("A", "B", "C", "D"), turn2], url=daemon.url,
                    extra={"load_mode": "layer"}))
    return {"async": async_, "layer": layer}


@pytest.fixture(scope="module")
def phase3(engines, models, daemon, phase2, modes):
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


def test_connector_counters_are_vllm_prometheus_series(phase2):
    """build_prom_metrics: vLLM's own Prometheus logger exports the connector's counters."""
    second = phase2["second"]
    metrics, sched, worker = second["metrics"], second["connector"]["scheduler"], second["connector"]["worker"]
    assert metrics["vllm:kvstore_lookups"] == sched["lookups"] > 0
    assert metrics["vllm:kvstore_lookup_hit_blocks"] == sched["lookup_hit_blocks"] > 0
    assert 0 < metrics["vllm:kvstore_loaded_blocks"] <= worker["loaded_blocks"]
    assert metrics["vllm:kvstore_load_failed_blocks"] == 0


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


@pytest.mark.parametrize("mode", ["async", "layer"])
def test_load_modes_outputs_identical(phase1, modes, mode):
    run = modes[mode]
    step = run["steps"][0]
    assert step["outputs"] == [phase1["baseline"][k] for k in "ABCD"]
    assert step["num_cached_tokens"] == [192, 192, 128, 160]
    w = run["connector"]["worker"]
    assert w["loaded_blocks"] >= 6 + 6 + 4 + 5
    if mode == "layer":
        assert w["layer_wait_seconds"] > 0   # attention layers waited for their pages


def test_next_turn_hits_through_previous_answer(phase2, modes):
    """Turn 1 ran in another engine; fresh engines see turn 1's prompt and answer as cached."""
    second = phase2["second"]["steps"][1]
    assert len(second["outputs"][0]) == TURN1_ANSWER and second["num_cached_tokens"] == [0]
    covered = (len(PROMPTS["T1"]) + TURN1_ANSWER - 1) // BLOCK * BLOCK   # 192: prompt + 42 answer tokens
    assert covered > len(PROMPTS["T1"])
    for mode in ("async", "layer"):
        assert modes[mode]["steps"][1]["num_cached_tokens"] == [covered]
    assert modes["async"]["steps"][1]["outputs"] == modes["layer"]["steps"][1]["outputs"]
    hasher = ChainHasher("xxh3_128", seed=0)
    assert len(hasher.chain(_turn2(phase2), BLOCK)) == 6


def test_async_load_of_vanished_blocks_is_recomputed(modes):
    run = modes["async"]
    first, lost = run["steps"][2], run["steps"][4]
    assert first["num_cached_tokens"] == [0]
    assert lost["outputs"] == first["outputs"]
    assert run["connector"]["worker"]["load_failed_blocks"] == 4
    assert run["connector"]["scheduler"]["lookup_hit_blocks"] >= 21 + 6 + 4


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


# -- naming rules without an engine: TP ranks, MLA, settings, the hash self-check ----------------

def _configs(tp: int, mla: bool) -> tuple[SimpleNamespace, SimpleNamespace]:
    """Stand-ins for vLLM's config and KV cache config (the attributes identity.py reads)."""
    if mla:   # one 576-wide latent vector per token (512 + 64 rope), no separate V
        spec = SimpleNamespace(num_kv_heads=1, head_size=576, dtype=torch.bfloat16, block_size=BLOCK,
                               page_size_bytes=BLOCK * 576 * 2)
    else:     # K and V, 2 KV heads of 32 per rank
        spec = SimpleNamespace(num_kv_heads=2, head_size=32, dtype=torch.bfloat16, block_size=BLOCK,
                               page_size_bytes=2 * BLOCK * 2 * 32 * 2)
    kv_cache = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    vllm = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
                           model_config=SimpleNamespace(model="test/model", use_mla=mla),
                           device_config=SimpleNamespace(device_type="cpu"))
    return vllm, kv_cache


def _blocks(ns: Namespace, hashes: list[bytes], fill: int) -> list[np.ndarray]:
    return [np.full(ns.block_bytes, fill, dtype=np.uint8) for _ in hashes]


def test_tensor_parallel_ranks_store_apart_and_hits_need_every_rank(daemon_factory):
    d = daemon_factory()
    vllm, kv_cache = _configs(tp=2, mla=False)
    settings = ConnectorSettings()
    rank0, rank1 = (namespace_for(vllm, kv_cache, settings, tp_rank=r) for r in (0, 1))
    assert rank0.id != rank1.id and (rank0.layout.tp_rank, rank1.layout.tp_rank) == (0, 1)
    assert [ns.id for ns in lookup_namespaces(vllm, kv_cache, settings)] == [rank0.id, rank1.id]
    assert is_writer(rank0, 0) and is_writer(rank1, 1)
    hashes = ChainHasher("xxh3_128", seed=0).chain(list(range(4 * BLOCK)), BLOCK)
    handles = [NamespaceHandle(ns, url=d.url) for ns in (rank0, rank1)]
    try:
        assert handles[0].put(hashes[:3], _blocks(rank0, hashes[:3], 1))
        assert handles[1].put(hashes[:2], _blocks(rank1, hashes[:2], 2))
        # rank 1 holds only 2 of rank 0's 3 blocks: the scheduler offers 2
        assert hits_on_every_rank(handles, hashes) == 2
        assert hits_on_every_rank(handles[:1], hashes) == 3
        assert hits_on_every_rank([], hashes) == 0
    finally:
        for h in handles:
            h.close()


def test_mla_is_stored_once_rank_free_and_read_by_every_rank(daemon_factory):
    d = daemon_factory()
    vllm, kv_cache = _configs(tp=2, mla=True)
    settings = ConnectorSettings()
    rank0, rank1 = (namespace_for(vllm, kv_cache, settings, tp_rank=r) for r in (0, 1))
    assert rank0.id == rank1.id
    layout = rank0.layout
    assert (layout.tp_rank, layout.tp_size, layout.kv_per_token, layout.num_kv_heads) == (0, 1, 1, 1)
    assert layout.block_bytes == layout.shape_bytes == 2 * BLOCK * 576 * 2
    assert [ns.id for ns in lookup_namespaces(vllm, kv_cache, settings)] == [rank0.id]
    assert is_writer(rank0, 0) and not is_writer(rank1, 1)   # one writer
    hashes = ChainHasher("xxh3_128", seed=0).chain(list(range(2 * BLOCK)), BLOCK)
    writer, reader = NamespaceHandle(rank0, url=d.url), NamespaceHandle(rank1, url=d.url)
    try:
        assert writer.put(hashes, _blocks(rank0, hashes, 7))
        outs = [np.zeros(rank1.block_bytes, dtype=np.uint8) for _ in hashes]
        assert reader.get_into(hashes, outs) == [rank1.block_bytes] * 2 and all((o == 7).all() for o in outs)
    finally:
        writer.close()
        reader.close()


def test_settings_refuse_unknown_modes_and_offer_sha256():
    assert ConnectorSettings().load_mode in LOAD_MODES
    assert ConnectorSettings.from_extra_config({"load_mode": "layer"}).load_mode == "layer"
    with pytest.raises(ValueError, match="load_mode"):
        ConnectorSettings.from_extra_config({"load_mode": "eager"})
    with pytest.raises(ValueError, match="hash_algorithm"):
        ConnectorSettings.from_extra_config({"hash_algorithm": "md5"})
    assert ConnectorSettings.from_extra_config({"save_mode": "layer"}).save_mode == "layer"
    with pytest.raises(ValueError, match="save_mode"):
        ConnectorSettings.from_extra_config({"save_mode": "forward"})
    with pytest.raises(ValueError, match="admission_hit_fraction"):
        ConnectorSettings.from_extra_config({"admission_hit_fraction": 1.5})
    with pytest.raises(ValueError, match="unknown keys"):
        ConnectorSettings.from_extra_config({"laod_mode": "sync"})
    hasher = checked_hasher(ConnectorSettings.from_extra_config({"hash_algorithm": "sha256", "hash_seed": 3}))
    assert hasher.algorithm == "sha256" and hasher.seed == 3 and hasher.digest_size == 32


def test_connector_disables_itself_when_hashing_fails_its_self_check(monkeypatch, caplog):
    def broken() -> None:
        raise HashSelfCheckFailed("xxh3_128 chain hash is 00, expected ff")

    monkeypatch.setattr(identity, "determinism_self_check", broken)
    with caplog.at_level(logging.ERROR, logger="kvstore.connectors.vllm"):
        assert checked_hasher(ConnectorSettings()) is None
    assert "kvstore connector DISABLED" in caplog.text and "self-check" in caplog.text


def test_a_failed_placement_is_a_load_error_not_an_engine_crash(daemon_factory):
    """Blocks fetched fine but placing them into the paged KV cache fails (here: a layer whose
    storage was released, as vLLM's sleep mode does): the job reports every block as a load
    error, so vLLM recomputes, and nothing is raised into the step."""
    d = daemon_factory()
    r, stderr = vllm_runner.run_script("vllm_placement_failure.py", d.url)
    assert r["fetched"] == [0, 1]                      # the daemon delivered both blocks
    assert r["bad"] == [0, 1] and r["good"] == []      # ... and both are reported for recompute
    assert "placing loaded blocks failed" in stderr

"""``blocks_per_chunk`` on real vLLM engines (CPU build, own venv) against a real daemon: one
kvstore block holds 2 vLLM blocks of 32 tokens (a 64-token chunk).

Two phases of two engines each, run in parallel within a phase (engine starts are the cost):

1. ``baseline`` (no connector) || ``first`` (chunks, ``sync``, prefix caching off): computes and
   saves A (3 full chunks), R (170 tokens: 5 full vLLM blocks but 2 full chunks), E, and turn 1
   of a conversation whose answer fills a chunk during decode; then loads A and R back.
2. ``layer`` (fresh engine, prefix caching off, loading over the side channel as from another
   host, so a layer group at a time): A and R hit from the daemon, turn 2 (turn 1 +
   answer + a new message) hits through the answer || ``async`` (prefix caching ON): Q shares
   A's first vLLM block only, so when A comes vLLM's own cache has computed half of A's first
   chunk: the chunk is fetched and only its second block placed; then E's chunks vanish between
   lookup and load and every vLLM block of them is recomputed.
"""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.keys import ChainHasher, KVLayout, Namespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402

BLOCK, N = 32, 2
CHUNK = N * BLOCK
MAX_TOKENS = 8
TURN1_ANSWER = 43     # 150 + 43 tokens: KV for 192 = 3 full chunks, the third filled while decoding

pytestmark = pytest.mark.timeout(1200)


def _prompts() -> dict[str, list[int]]:
    tok = vllm_runner.prompt_tokens(20261201)
    a = tok(200)
    return {"A": a, "R": tok(170), "E": tok(130), "T1": tok(150), "Q": a[:BLOCK] + tok(100), "new": tok(20)}


P = _prompts()


def _gen(*names: str, **kw) -> dict:
    return {"generate": [P[n] for n in names], "max_tokens": MAX_TOKENS, **kw}


def _job(model: dict, steps: list, url: str | None = None, prefix_caching: bool = False, **extra) -> dict:
    job = {"build": model, "engine": {"model": model["out_dir"], "enable_prefix_caching": prefix_caching,
                                      "max_model_len": 1024, "kv_cache_memory_bytes": 32 * 2**20}, "steps": steps}
    if url is not None:
        job["kv_transfer_config"] = vllm_runner.kvstore_transfer_config(
            f"grpc://{url}", retry_after_s=30, blocks_per_chunk=N, **extra)
    return job


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from daemon_util import start_daemon

    python = vllm_runner.vllm_python()
    work = str(tmp_path_factory.mktemp("vllm_chunks"))
    model = vllm_runner.tiny_model(tmp_path_factory)
    daemon = start_daemon(tmp_path_factory.mktemp("kvd"))
    try:
        baseline, first = vllm_runner.run_jobs(python, work, [
            ("baseline", _job(model, [_gen("A", "R", "Q", "E")])),
            ("first", _job(model, [_gen("A", "R", "E"), {"generate": [P["T1"]], "max_tokens": TURN1_ANSWER},
                                   {"drain": True}, _gen("A", "R")], url=daemon.url))], timeout_s=600)
        turn2 = P["T1"] + first["steps"][1]["outputs"][0] + P["new"]
        layer, async_ = vllm_runner.run_jobs(python, work, [
            ("layer", _job(model, [_gen("A", "R"), {"generate": [turn2], "max_tokens": MAX_TOKENS}],
                           url=daemon.url, load_mode="layer", transport="bulk")),   # as from another host
            ("async", _job(model, [_gen("Q"), _gen("A"), _gen("E", lose_after_lookup=True)], url=daemon.url,
                           prefix_caching=True, load_mode="async"))], timeout_s=600)
        with daemon.client() as c:
            held = _held(c, first)
        yield {"base": dict(zip(["A", "R", "Q", "E"], baseline["steps"][0]["outputs"])), "first": first,
               "layer": layer, "async": async_, "held": held}
    finally:
        daemon.kill()


def _held(client, result: dict) -> dict:
    """What the daemon holds of A and R: in the chunk namespace, and in the N = 1 namespace."""
    chunk_ns = Namespace.from_dict(result["connector"]["namespace"])
    lay = chunk_ns.layout.to_dict()
    block_ns = Namespace(KVLayout(**{**lay, "block_tokens": BLOCK, "block_bytes": lay["block_bytes"] // N}),
                         cache_salt=chunk_ns.cache_salt)
    hasher = ChainHasher("xxh3_128", seed=0)
    ids = {k: client.register_namespace(ns) for k, ns in (("chunk", chunk_ns), ("block", block_ns))}
    out = {"ids": ids, "layout": lay}
    for name in ("A", "R"):
        out[name] = client.exists(ids["chunk"], hasher.chain(P[name], CHUNK))
        out[name + "_blocks"] = client.exists(ids["block"], hasher.chain(P[name], BLOCK))
    out["A_size"] = len(client.get(ids["chunk"], hasher.chain(P["A"], CHUNK)[:1])[0])
    return out


def test_chunked_saves_and_sync_loads_are_token_identical(runs):
    first, base = runs["first"], runs["base"]
    assert first["steps"][0]["outputs"] == [base[k] for k in "ARE"]
    again = first["steps"][3]
    assert again["outputs"] == [base[k] for k in "AR"]
    # chunks only: A 3 x 64 tokens; R 2 x 64, not its fifth full vLLM block
    assert again["num_cached_tokens"] == [3 * CHUNK, 2 * CHUNK]
    w = first["connector"]["worker"]
    assert w["loaded_blocks"] == 5 and w.get("load_failed_blocks", 0) == 0
    # A 3, R 2, E 2, turn 1: 2 prompt chunks + 1 filled while decoding
    assert w["saved_blocks"] == 3 + 2 + 2 + 3 and w.get("save_failed_blocks", 0) == 0


def test_a_chunk_is_its_own_namespace_of_n_blocks(runs):
    held = runs["held"]
    lay = held["layout"]
    assert lay["block_tokens"] == CHUNK and lay["layout"] == "vllm_cpu"
    assert lay["block_bytes"] == held["A_size"] == N * 2 * 2 * BLOCK * lay["num_kv_heads"] * lay["head_dim"] * 2
    assert held["ids"]["chunk"] != held["ids"]["block"]
    assert all(held["A"]) and len(held["A"]) == 3
    assert all(held["R"]) and len(held["R"]) == 2          # the partial third chunk was never saved
    assert not any(held["A_blocks"] + held["R_blocks"])   # nothing under the one-block namespace


def test_fresh_engine_in_layer_mode_hits_the_chunks_and_the_answer(runs):
    layer, base = runs["layer"], runs["base"]
    assert layer["steps"][0]["outputs"] == [base[k] for k in "AR"]
    assert layer["steps"][0]["num_cached_tokens"] == [3 * CHUNK, 2 * CHUNK]
    # turn 2: turn 1's prompt and answer up to the last full chunk (192 tokens) came from the daemon
    assert layer["steps"][1]["num_cached_tokens"] == [(150 + TURN1_ANSWER - 1) // CHUNK * CHUNK]
    assert layer["connector"]["worker"]["layer_wait_seconds"] > 0
    assert layer["connector"]["worker"]["load_ranged_gets"] >= 2   # layer 0, then layer 1: by layers


def test_a_chunk_partly_in_vllms_cache_places_only_the_missing_blocks(runs):
    run, base = runs["async"], runs["base"]
    q, a = run["steps"][0], run["steps"][1]
    assert q["outputs"] == [base["Q"]] and q["num_cached_tokens"] == [0]
    assert a["outputs"] == [base["A"]]
    assert a["num_cached_tokens"] == [3 * CHUNK]   # 32 from vLLM's own cache, 160 loaded
    w = run["connector"]["worker"]
    assert w["load_local_blocks"] == 1             # A's first block: fetched in its chunk, not placed


def test_a_chunk_that_never_arrives_is_recomputed_block_by_block(runs):
    run, base = runs["async"], runs["base"]
    lost = run["steps"][2]
    assert lost["outputs"] == [base["E"]]
    w = run["connector"]["worker"]
    assert w["loaded_blocks"] == 3 and w["load_failed_blocks"] == 2   # A's 3 chunks; E's 2 lost


def test_a_missing_chunk_fails_all_its_blocks_an_arrived_one_places_only_the_planned(daemon_factory):
    """LoadJob against a real daemon (no engine): chunk 1 arrived, chunk 2 did not."""
    d = daemon_factory()
    r, _ = vllm_runner.run_script("vllm_chunk_loads.py", d.url)
    assert r["good"] == [0] and r["bad"] == [6, 7]       # both vLLM blocks of the missing chunk
    assert r["placed_block_5"] and r["untouched_written"] == []   # the -1 block was left alone
    assert r["stats"] == {"loaded_blocks": 1, "load_failed_blocks": 1, "load_local_blocks": 1}

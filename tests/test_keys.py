"""Block identity: chained hashes are deterministic everywhere, namespaces separate layouts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore import keys
from kvstore.errors import HashSelfCheckFailed, InvalidArgument
from kvstore.keys import ChainHasher, KVLayout, Namespace, block_key, check_block_hash

LAYOUT = KVLayout(model="m/llama", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=16)


def _independent_chain(algorithm: str, seed: int, tokens: list[int], bt: int, extras=None) -> list[str]:
    """The documented scheme re-implemented from scratch with hashlib/xxhash one-shot calls:
    h_i = H(seed; h_{i-1} || extra_i || tokens_i as uint32 LE), root = H(seed; "kvstore-root" || seed)."""
    def digest(data: bytes) -> bytes:
        if algorithm == "xxh3_128":
            return xxhash.xxh3_128_digest(data, seed=seed)
        return hashlib.sha256(seed.to_bytes(8, "little") + data).digest()

    h = digest(b"kvstore-root" + seed.to_bytes(8, "little"))
    out = []
    for i in range(len(tokens) // bt):
        extra = keys._encode_extra(extras[i]) if extras else b""
        raw = b"".join(t.to_bytes(4, "little") for t in tokens[i * bt:(i + 1) * bt])
        h = digest(h + extra + raw)
        out.append(h.hex())
    return out


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_chain_matches_an_independent_implementation(algorithm):
    tokens = [(i * 7919) % 50_000 for i in range(100)]
    got = [h.hex() for h in ChainHasher(algorithm, seed=5).chain(tokens, 16)]
    assert len(got) == 6  # the 4-token tail is not a full block
    assert got == _independent_chain(algorithm, 5, tokens, 16)
    assert len(bytes.fromhex(got[0])) == (16 if algorithm == "xxh3_128" else 32)


def test_known_vectors_are_pinned():
    # Literal values: if the scheme ever changes, every stored block becomes unreachable.
    assert keys.known_answers() == {
        "xxh3_128": "fdf11eb952b400323d39642e1830e21d",
        "sha256": "2ac39bb708bd8d91debe26c41c99d0f2ae4f5e8a0a80f17f075fd8122edf2882",
        "namespace": "9da391017730a74677473b6058c27ff0",
    }
    keys.determinism_self_check()


def test_input_types_give_the_same_hash():
    tokens = list(range(1000, 1064))
    h = ChainHasher()
    want = h.chain(tokens, 16)
    assert h.chain(np.array(tokens, dtype=np.int64), 16) == want
    assert h.chain(np.array(tokens, dtype=np.int32), 16) == want
    assert h.chain(tuple(tokens), 16) == want


def test_chaining_prefix_property_and_parent():
    h = ChainHasher()
    tokens = list(range(64))
    full = h.chain(tokens, 16)
    assert h.chain(tokens[:32], 16) == full[:2]  # a prefix's hashes are a prefix of the hashes
    assert h.chain(tokens[32:], 16, parent=full[1]) == full[2:]  # continue from a parent
    other = h.chain([1] + tokens[1:], 16)
    assert all(a != b for a, b in zip(other, full))  # one changed token changes every later hash
    assert ChainHasher(seed=1).chain(tokens, 16) != full


def test_extra_keys_change_the_hash():
    h = ChainHasher()
    tokens = list(range(32))
    plain = h.chain(tokens, 16)
    assert h.chain(tokens, 16, extra_keys=[None, None]) == plain
    lora = h.chain(tokens, 16, extra_keys=["lora-a", None])
    assert lora[0] != plain[0] and lora[1] != plain[1]
    assert h.chain(tokens, 16, extra_keys=["lora-b", None])[0] != lora[0]
    mm = h.chain(tokens, 16, extra_keys=[None, [b"\x01" * 16]])
    assert mm[0] == plain[0] and mm[1] != plain[1]
    # type-tagged: the int 1, the string "1" and the bytes b"1" are different extras
    variants = {h.chain(tokens, 16, extra_keys=[x, None])[0] for x in (1, "1", b"1", True, [1])}
    assert len(variants) == 5
    with pytest.raises(InvalidArgument, match="extra_keys"):
        h.chain(tokens, 16, extra_keys=[None])
    with pytest.raises(InvalidArgument, match="extra_keys"):
        h.chain(tokens, 16, extra_keys=[1.5, None])


def test_bad_hasher_arguments():
    with pytest.raises(InvalidArgument, match="hash_algorithm"):
        ChainHasher("md5")
    with pytest.raises(InvalidArgument, match="hash_seed"):
        ChainHasher(seed=-1)
    with pytest.raises(InvalidArgument, match="block_tokens"):
        ChainHasher().chain([1, 2], 0)


_CHILD = """
import json, sys
from kvstore.keys import ChainHasher, KVLayout, Namespace, determinism_self_check
determinism_self_check()
tokens = list(range(5000, 5000 + 256))
out = {a: [h.hex() for h in ChainHasher(a, seed=9).chain(tokens, 16, extra_keys=[None] * 15 + ["x"])]
       for a in ("xxh3_128", "sha256")}
out["ns"] = Namespace(KVLayout(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                               block_tokens=16), tenant="t").id.hex()
out["pyhash"] = hash("kvstore")
print(json.dumps(out))
"""


def test_deterministic_across_processes_with_different_hash_seeds():
    results = []
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        p = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                           timeout=120, check=True)
        results.append(json.loads(p.stdout))
    # the processes really differ in Python's salted hash() ...
    assert len({r.pop("pyhash") for r in results}) == 3
    # ... and agree on every block hash and namespace id
    assert results[0] == results[1] == results[2]
    assert len(results[0]["xxh3_128"]) == 16


def test_opaque_engine_hashes_are_accepted():
    vllm_style = hashlib.sha256(b"engine block").digest()          # 32 bytes
    sglang_style = (123456789).to_bytes(8, "little")                 # 8 bytes
    assert check_block_hash(vllm_style) == vllm_style
    assert check_block_hash(bytearray(sglang_style)) == sglang_style
    ns = Namespace(LAYOUT)
    assert block_key(ns.id, vllm_style) == ns.id + vllm_style
    for bad in (b"", b"x" * 65, "text", 5):
        with pytest.raises(InvalidArgument, match="hashes"):
            check_block_hash(bad)


def test_namespace_id_changes_with_every_identity_field():
    base = Namespace(LAYOUT, tenant="a", cache_salt="s")
    assert len(base.id) == 16
    assert Namespace(LAYOUT, tenant="a", cache_salt="s").id == base.id  # deterministic
    changes = {
        "model": "m/other", "num_layers": 5, "num_kv_heads": 4, "head_dim": 128, "dtype": "float16",
        "block_tokens": 32, "layout": "vllm_nhd", "kv_per_token": 1, "tp_size": 2, "pp_size": 2,
        "cp_size": 2, "block_bytes": LAYOUT.block_bytes + 4096,
    }
    ids = {base.id}
    for field, value in changes.items():
        lay = dataclasses.replace(LAYOUT, **{field: value, "block_bytes": 0} if field != "block_bytes"
                                  else {field: value})
        ids.add(Namespace(lay, tenant="a", cache_salt="s").id)
    for rank in ("tp", "pp", "cp"):
        lay = dataclasses.replace(LAYOUT, **{f"{rank}_size": 2, f"{rank}_rank": 1})
        ids.add(Namespace(lay, tenant="a", cache_salt="s").id)
    ids.add(Namespace(LAYOUT, tenant="b", cache_salt="s").id)
    ids.add(Namespace(LAYOUT, tenant="a", cache_salt="t").id)
    ids.add(Namespace(LAYOUT, tenant="", cache_salt="").id)
    assert len(ids) == 1 + len(changes) + 3 + 3


def test_layout_validation_names_the_field():
    assert LAYOUT.block_bytes == 4 * 2 * 16 * 2 * 64 * 2
    for field, value in (("num_layers", 0), ("head_dim", -1), ("dtype", "float128"), ("tp_rank", 1),
                         ("block_bytes", -5)):
        with pytest.raises(InvalidArgument, match=f"layout.{field}"):
            dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(InvalidArgument, match="layout.model"):
        dataclasses.replace(LAYOUT, model="")
    d = Namespace(LAYOUT, tenant="x").to_dict()
    assert Namespace.from_dict(json.loads(json.dumps(d))).id == Namespace(LAYOUT, tenant="x").id
    with pytest.raises(InvalidArgument, match="unknown fields"):
        KVLayout.from_dict({**LAYOUT.to_dict(), "colour": "red"})


@pytest.mark.parametrize("what", ["xxh3_128", "sha256", "namespace"])
def test_self_check_fails_loudly_when_a_vector_is_wrong(monkeypatch, what):
    if what == "namespace":
        monkeypatch.setattr(keys, "_KNOWN_NAMESPACE_ID", "00" * 16)
    else:
        monkeypatch.setitem(keys._KNOWN_ANSWERS, what, "00" * 16)
    with pytest.raises(HashSelfCheckFailed, match=what if what != "namespace" else "namespace id"):
        keys.determinism_self_check()


def test_self_check_catches_a_hash_function_that_changed(monkeypatch):
    # Simulate a build whose xxhash computes something else (e.g. a different seed handling).
    real = xxhash.xxh3_128_digest
    monkeypatch.setattr(keys.xxhash, "xxh3_128_digest", lambda data, seed=0: real(data, seed + 1))
    with pytest.raises(HashSelfCheckFailed, match="xxh3_128 chain hash"):
        keys.determinism_self_check()

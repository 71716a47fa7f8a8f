"""The compiled rotation (kvstore.codecs.fast_rotation) gives rotation.rotate's bits exactly, on
values where nearly every butterfly sum rounds (a float32 range of 2**40 within each group), with
its input widening and bf16 output rounding; and the codecs built on it decode what they decoded
before (their payloads are pinned by digest)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from kvstore.codecs import decode_block, encode_block, rotation  # noqa: E402
from kvstore.codecs.fast_rotation import (hadamard64_from_bf16, hadamard64_to_bf16, int4_hadamard64_to_bf16,  # noqa: E402
                                          int8_hadamard64_to_bf16)
from kvstore.keys import KVLayout  # noqa: E402

GROUPS = 512


def wide_floats(seed: int, n: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal(n) * np.exp2(g.integers(-20, 20, n))).astype(np.float32)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (the codecs' rounding)."""
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def reference(x: np.ndarray) -> torch.Tensor:
    return rotation.rotate(torch.from_numpy(x.copy()), 64)


@njit
def _from_bf16(src, a):
    lo, hi = np.empty(GROUPS, np.int32), np.empty(GROUPS, np.int32)
    for g in range(GROUPS):
        lo[g], hi[g] = hadamard64_from_bf16(src, g * 64, np.float32(1 / 64), a, g * 64)
    return lo, hi


@njit
def _to_bf16(a, out):
    for g in range(GROUPS):
        hadamard64_to_bf16(a, g * 64, out, g * 32)


@njit
def _int8(codes, scales, out):
    for g in range(GROUPS):
        int8_hadamard64_to_bf16(codes, g * 64, scales[g], out, g * 32)


@njit
def _int4(codes, scales, mins, out):
    for g in range(GROUPS):
        int4_hadamard64_to_bf16(codes, g * 32, scales[g], mins[g], 0, out, g * 32)


def test_encode_rotation_and_its_extremes_are_rotate_for_encode_bit_for_bit():
    x = torch.from_numpy(wide_floats(0, GROUPS * 64)).to(torch.bfloat16)
    a = np.empty(GROUPS * 64, np.float32)
    lo, hi = _from_bf16(x.view(torch.int16).numpy().view(np.uint16), a)
    want = rotation.rotate_for_encode(x.float(), 64).numpy()
    assert np.array_equal(a.view(np.uint32), want.view(np.uint32))
    groups = want.reshape(GROUPS, 64)
    assert np.array_equal(_key_value(lo), groups.min(axis=1))
    assert np.array_equal(_key_value(hi), groups.max(axis=1))


def _key_value(keys: np.ndarray) -> np.ndarray:
    """bits.order_key32 keys back to float32."""
    b = keys.astype(np.int64).astype(np.uint32)
    return (b ^ ((keys >> 31).astype(np.uint32) & np.uint32(0x7FFFFFFF))).view(np.float32)


def test_decode_rotation_rounds_to_bf16_as_the_reference():
    x = wide_floats(1, GROUPS * 64)
    out = np.empty(GROUPS * 32, np.uint32)
    _to_bf16(x, out)
    assert np.array_equal(out.view(np.uint16), bf16_bits(reference(x)))


def test_int8_dequantise_and_rotate_back_as_the_reference():
    g = np.random.default_rng(2)
    codes = g.integers(0, 256, GROUPS * 64, dtype=np.uint8)
    scales = np.exp2(g.integers(-30, 30, GROUPS)).astype(np.float32) * np.float32(1.5)
    out = np.empty(GROUPS * 32, np.uint32)
    _int8(codes, scales, out)
    y = codes.view(np.int8).astype(np.float32).reshape(GROUPS, 64) * scales[:, None]
    assert np.array_equal(out.view(np.uint16), bf16_bits(reference(y.reshape(-1))))


def test_int4_dequantise_and_rotate_back_as_the_reference():
    g = np.random.default_rng(3)
    codes = g.integers(0, 256, GROUPS * 32, dtype=np.uint8)
    scales = np.exp2(g.integers(-30, 10, GROUPS)).astype(np.float32) * np.float32(1.25)
    mins = -np.exp2(g.integers(-10, 10, GROUPS)).astype(np.float32) * np.float32(1.75)   # (sums round)
    out = np.empty(GROUPS * 32, np.uint32)
    _int4(codes, scales, mins, out)
    q = np.stack((codes & 15, codes >> 4), axis=1).reshape(GROUPS, 64).astype(np.float32)
    y = q * scales[:, None] + mins[:, None]
    assert np.array_equal(out.view(np.uint16), bf16_bits(reference(y.reshape(-1))))


def _layout(head_dim: int) -> KVLayout:
    return KVLayout(f"test/rot{head_dim}", num_layers=3, num_kv_heads=2, head_dim=head_dim, dtype="bfloat16",
                    block_tokens=16, layout="kv,layer,token,head,dim")


#: sha256 of payload + decoded block for a fixed block, as the loop-based kernels (before
#: fast_rotation) wrote them: the wire format and the decoded bits are unchanged
PINNED = {
    ("int8_had", 64): "b2cd9416c932bae6e7c22ea280d5e0da705bcab6f3e20f557327424fac6bd6eb",
    ("int8_had", 128): "9f66c9d5014e8430f7e9987159e26acce449931b765c4bae046c49f4d5351915",
    ("int8_had", 96): "6c8f97fb5eeb131c85aa4b2d237eaba69e3c118f6df66363f6bfbe75c8eca788",
    ("int4_g64_k16_had", 64): "b09b7d67e194344447a38d2429637333fc6300ef67c3ce96882217ec17f09e68",
    ("int4_g64_k16_had", 128): "a9b52568075257b17e3efa334f63cd288a19518716c50b8b6b0cf63eaa1bdadc",
}


@pytest.mark.parametrize("codec, head_dim", [("int8_had", 64), ("int8_had", 128), ("int8_had", 96),
                                             ("int4_g64_k16_had", 64), ("int4_g64_k16_had", 128)])
def test_rotated_codecs_keep_their_payloads_and_decoded_bits(codec, head_dim):
    layout = _layout(head_dim)
    g = torch.Generator().manual_seed(head_dim)
    n = layout.block_bytes // 2
    raw = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)).to(torch.bfloat16)
    cid, payload = encode_block(codec, raw.view(torch.uint8), layout)
    out = torch.empty(layout.block_bytes, dtype=torch.uint8)
    decode_block(cid, payload, layout, out=out)
    digest = hashlib.sha256(bytes(payload) + out.numpy().tobytes()).hexdigest()
    assert digest == PINNED[(codec, head_dim)]

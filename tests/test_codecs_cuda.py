"""Codecs on a CUDA device: the same torch code as on the CPU must give the same bytes.

Skipped without CUDA. Run on a GPU machine with ``pytest tests/test_codecs_cuda.py``
(benchmarks/gpu_check.sh does).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codecs import CODEC_IDS, decode_block, encode_block
from kvstore.errors import CodecError

from test_codecs import (LAYOUTS, LOSSY, as_bytes, make_layout, pack_block, realistic_kv, signed_zero_blocks,
                         special_values_block)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"


@pytest.mark.parametrize("codec", list(CODEC_IDS))
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_decode_into_a_gpu_buffer_matches_cpu_decode(codec, layout_name):
    """The client's path: payload arrives in host memory, the block is decoded on the GPU."""
    layout = make_layout(layout_name, L=3, T=32, H=2, D=64)
    raw = as_bytes(pack_block(*realistic_kv(3, 32, 2, 64, seed=11), layout_name))
    cid, payload = encode_block(codec, raw, layout)
    on_cpu = decode_block(cid, payload, layout)
    out = torch.empty(layout.block_bytes, dtype=torch.uint8, device=DEVICE)
    got = decode_block(cid, payload, layout, out=out)
    assert got.device.type == "cuda" and got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), on_cpu)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_encode_on_gpu_gives_the_cpu_payload(codec, dtype):
    """Encoding a CUDA tensor runs the torch reference on the GPU; every step (float32
    division, round-half-even, RNE casts) is exactly rounded, so the payload is byte-identical
    to the CPU's. Two things would break that and the codecs avoid them: dividing by a Python
    number (CUDA multiplies by its inexact reciprocal: ``exact.div_exact``) and storing a zero
    statistic's sign (reductions meet +0/-0 in another order: ``exact.canonical_zero``).
    CPU twins: test_payload_does_not_depend_on_device_arithmetic and
    test_int4_statistics_do_not_depend_on_the_sign_of_zero in test_codecs.py."""
    layout = make_layout(L=3, T=32, H=2, D=64, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    for raw in (as_bytes(pack_block(*realistic_kv(3, 32, 2, 64, torch_dtype, seed=12), layout.layout)),
                special_values_block(make_layout(L=3, T=32, H=2, D=64), seed=13) if dtype == "bfloat16" else None,
                *signed_zero_blocks(layout, seed=14)):
        if raw is None:
            continue
        cid, on_cpu = encode_block(codec, raw, layout)
        gpu_raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(DEVICE)
        cid2, on_gpu = encode_block(codec, gpu_raw, layout)
        assert cid2 == cid and isinstance(on_gpu, np.ndarray)
        assert np.array_equal(on_cpu, on_gpu), f"{int((on_cpu != on_gpu).sum())} bytes differ"


@pytest.mark.parametrize("codec", LOSSY)
def test_nan_on_gpu_is_refused(codec):
    layout = make_layout()
    k, v = realistic_kv(2, 32, 2, 64)
    k[1, 3, 0, 5] = float("inf")
    block = pack_block(k, v, layout.layout).view(torch.uint8).to(DEVICE)
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode_block(codec, block, layout)


def test_damaged_payload_into_gpu_buffer_is_refused():
    layout = make_layout()
    cid, payload = encode_block("int4_g32", as_bytes(pack_block(*realistic_kv(2, 32, 2, 64), layout.layout)), layout)
    payload = payload.copy()
    payload[-3] ^= 1
    out = torch.zeros(layout.block_bytes, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError, match="checksum"):
        decode_block(cid, payload, layout, out=out)
    assert int(out.count_nonzero()) == 0  # nothing was written


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("engine_name", ["vllm_flash_attn", "vllm_lbhnc", "vllm_mla", "sglang_mha_layer_first",
                                         "sglang_mha_page_head", "sglang_mla_page_first", "lmcache_kv"])
def test_engine_layouts_on_gpu_give_the_cpu_payload_and_block(engine_name, codec):
    """K-only / V-only segments, one-layer segments and MLA latents: a GPU encode gives the CPU's
    payload, and a decode into a GPU buffer the CPU's block."""
    from test_codecs_layouts import ENGINES

    engine = ENGINES[engine_name]()
    for block in engine.blocks(engine.state)[:2]:
        raw = block.view(torch.uint8)
        cid, on_cpu = encode_block(codec, raw, engine.layout)
        _, on_gpu = encode_block(codec, raw.to(DEVICE), engine.layout)
        assert np.array_equal(on_cpu, on_gpu), f"{int((on_cpu != on_gpu).sum())} bytes differ"
        out = torch.empty(engine.layout.block_bytes, dtype=torch.uint8, device=DEVICE)
        decode_block(cid, on_cpu, engine.layout, out=out)
        assert torch.equal(out.cpu(), decode_block(cid, on_cpu, engine.layout))

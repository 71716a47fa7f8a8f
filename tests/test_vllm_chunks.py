"""Chunks of N vLLM blocks (``blocks_per_chunk``) are what their layout name says (issue 13 item 6):
N pages gathered out of FlashAttention, FlashInfer, MLA or vLLM-CPU page tensors and repacked by
``ChunkPacking`` are, element by element, one block of N x block_size tokens in the layout the
namespace names, so FP8 / INT4 tier codecs read K, V, tokens, heads and dims correctly and the
chunk round-trips through them; unpacking gives back the N blocks byte for byte.

Tensors are on the CPU (CI has no GPU) but in the backends' shapes; no engine is needed."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_block, encode_block
from kvstore.codecs import layout as codec_layout
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.identity import layout_name, page_shape_matches
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.connectors.vllm.settings import ConnectorSettings
from kvstore.keys import KVLayout

NB, BS, H, D, LAYERS, N = 8, 16, 4, 32, 3, 2
PICK = [5, 1, 3, 6]   # two chunks of two blocks, out of order in the paged cache


def caches(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    shape = {"flash_attn": (2, NB, BS, H, D), "flashinfer": (NB, 2, BS, H, D), "mla": (NB, BS, 576),
             "cpu": (NB, H, BS, 2 * D)}[kind]
    return {f"layer.{i}": torch.randn(*shape, generator=g).to(torch.bfloat16) for i in range(LAYERS)}


def layout_for(kind: str, block_tokens: int, block_bytes: int) -> KVLayout:
    mla = kind == "mla"
    return KVLayout(model="test/chunks", num_layers=LAYERS, num_kv_heads=1 if mla else H,
                    head_dim=576 if mla else D, dtype="bfloat16", block_tokens=block_tokens,
                    layout=layout_name("cpu" if kind == "cpu" else "cuda", mla), kv_per_token=1 if mla else 2,
                    block_bytes=block_bytes)


def parts_of(row: torch.Tensor, lay: KVLayout) -> list[torch.Tensor]:
    """The codec's reading of one stored block: K, V (or the latent) as [layers, tokens, heads, dim]."""
    return codec_layout.part_views(row.view(torch.bfloat16), codec_layout.parse(lay))


@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "mla", "cpu"])
def test_a_chunk_is_one_block_of_n_times_the_tokens_in_its_layout(kind):
    kv = caches(kind, torch.Generator().manual_seed(11))
    paged = PagedBlocks(kv, list(kv), NB)
    block_lay = layout_for(kind, BS, paged.block_bytes)
    chunk_lay = layout_for(kind, N * BS, N * paged.block_bytes)
    assert page_shape_matches(chunk_lay, paged.page_shapes, N)
    assert not page_shape_matches(chunk_lay, paged.page_shapes, 1) or kind == "cpu"
    packing = ChunkPacking(chunk_lay, paged.page_bytes, paged.page_shapes, N)
    blocks = paged.host_buffer(len(PICK))
    paged.gather(PICK, blocks)
    chunks = packing.to_chunks(blocks)
    assert chunks.shape == (len(PICK) // N, N * paged.block_bytes)
    for c, row in enumerate(chunks):
        # what the codec reads in the chunk = the N blocks' own K / V, concatenated along tokens
        per_block = [parts_of(blocks[c * N + j], block_lay) for j in range(N)]
        for p, part in enumerate(parts_of(row, chunk_lay)):
            assert torch.equal(part, torch.cat([b[p] for b in per_block], dim=1))
    assert torch.equal(packing.to_blocks(chunks), blocks)   # and back, byte for byte


@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "mla", "cpu"])
def test_loads_place_each_layer_straight_out_of_the_chunks(kind):
    """What a load does: no unpacked copy, each layer placed from the fetched chunks; a block the
    plan marks -1 (vLLM's own cache holds it) and every block not named stay untouched."""
    kv = caches(kind, torch.Generator().manual_seed(14))
    paged = PagedBlocks(kv, list(kv), NB)
    lay = layout_for(kind, N * BS, N * paged.block_bytes)
    packing = ChunkPacking(lay, paged.page_bytes, paged.page_shapes, N)
    blocks = paged.host_buffer(len(PICK))
    paged.gather(PICK, blocks)
    chunks = packing.to_chunks(blocks)
    dst = {k: torch.zeros_like(v) for k, v in kv.items()}
    into = PagedBlocks(dst, list(dst), NB)
    slots = [-1, 2, 7, 0]                     # chunk 0 -> (kept, block 2); chunk 1 -> blocks 7 and 0
    plan = packing.placement(slots, len(chunks), into.device)
    for i in range(LAYERS):
        packing.place_layer(into, i, chunks, plan)
    back = into.host_buffer(3)
    into.gather([2, 7, 0], back)
    assert torch.equal(back, blocks[1:])       # source blocks 1, 3, 6 landed in 2, 7, 0
    others = into.host_buffer(NB - 3)
    into.gather([b for b in range(NB) if b not in (2, 7, 0)], others)
    assert not others.any()


@pytest.mark.parametrize("kind", ["flash_attn", "cpu"])
@pytest.mark.parametrize("codec", ["fp8", "int4_g64"])
def test_a_chunk_round_trips_through_a_tier_codec(kind, codec):
    kv = caches(kind, torch.Generator().manual_seed(12))
    paged = PagedBlocks(kv, list(kv), NB)
    chunk_lay = layout_for(kind, N * BS, N * paged.block_bytes)
    packing = ChunkPacking(chunk_lay, paged.page_bytes, paged.page_shapes, N)
    blocks = paged.host_buffer(N)
    paged.gather(PICK[:N], blocks)
    row = packing.to_chunks(blocks)[0]
    codec_id, payload = encode_block(codec, row, chunk_lay)
    assert codec_id != 0 and payload.nbytes < 0.6 * row.numel()      # encoded, not stored raw
    back = packing.to_blocks(decode_block(codec_id, payload, chunk_lay).view(1, -1))
    for j in range(N):   # decoded values land in their own vLLM block, close to the source
        for i, name in enumerate(kv):
            got = back[j, paged.offsets[i]:paged.offsets[i + 1]].view(torch.bfloat16).float()
            want = blocks[j, paged.offsets[i]:paged.offsets[i + 1]].view(torch.bfloat16).float()
            err = (got - want).abs().max() / want.abs().max()
            assert err < (0.07 if codec == "fp8" else 0.3), (kind, codec, name, float(err))


def test_one_block_per_chunk_is_todays_blocks_without_a_copy():
    kv = caches("flash_attn", torch.Generator().manual_seed(13))
    paged = PagedBlocks(kv, list(kv), NB)
    packing = ChunkPacking(layout_for("flash_attn", BS, paged.block_bytes), paged.page_bytes, paged.page_shapes, 1)
    blocks = paged.host_buffer(2)
    assert packing.to_chunks(blocks) is blocks and packing.to_blocks(blocks) is blocks


def test_settings_refuse_a_bad_chunk_size_by_name():
    assert ConnectorSettings().blocks_per_chunk >= 1
    assert ConnectorSettings.from_extra_config({"blocks_per_chunk": "4"}).blocks_per_chunk == 4
    for bad in (0, -2, 5000, "many", None):
        with pytest.raises(ValueError, match="blocks_per_chunk"):
            ConnectorSettings.from_extra_config({"blocks_per_chunk": bad})
    with pytest.raises(ValueError, match="unknown keys"):
        ConnectorSettings.from_extra_config({"block_per_chunk": 4})

"""The vLLM connector describes GPU blocks so that codecs can read them (issue #16): a block as
``PagedBlocks`` gathers it out of FlashAttention, FlashInfer or MLA page tensors is exactly what
the layout name the connector gives it says, so a lossy codec finds K, V, tokens, heads and dims
(checked against the source tensors, element by element); a backend whose pages look otherwise
is refused by the worker's check instead of being stored under a wrong description.

The tensors are on the CPU device here (CI has no GPU) but in the GPU backends' shapes; the
names depend on the device type only, as the scheduler (which has no tensors) computes them."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_block, encode_block
from kvstore.codecs import layout as codec_layout
from kvstore.connectors.vllm.identity import layout_name, page_shape_matches
from kvstore.connectors.vllm.paged_blocks import PagedBlocks
from kvstore.keys import KVLayout

NB, BS, H, D, LAYERS = 6, 16, 4, 64, 3
PICK = [4, 1, 3]   # blocks gathered, out of order


def caches(kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    shape = {"flash_attn": (2, NB, BS, H, D), "flashinfer": (NB, 2, BS, H, D), "mla": (NB, BS, 576)}[kind]
    return {f"layer.{i}": torch.randn(*shape, generator=generator).to(torch.bfloat16) for i in range(LAYERS)}


def layout_for(kind: str, paged: PagedBlocks) -> KVLayout:
    mla = kind == "mla"
    return KVLayout(model="test/vllm-gpu-layout", num_layers=LAYERS, num_kv_heads=1 if mla else H,
                    head_dim=576 if mla else D, dtype="bfloat16", block_tokens=BS, layout=layout_name("cuda", mla),
                    kv_per_token=1 if mla else 2, block_bytes=paged.block_bytes)


def kv_of(kind: str, t: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The source tensors of one layer's page, as [tokens, heads, dim] (K then V, or the latent)."""
    if kind == "flash_attn":
        return [t[0, block], t[1, block]]
    if kind == "flashinfer":
        return [t[block, 0], t[block, 1]]
    return [t[block].unsqueeze(1)]


@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "mla"])
def test_gathered_gpu_blocks_are_what_their_layout_name_says(kind):
    kv = caches(kind, torch.Generator().manual_seed(3))
    names = list(kv)
    paged = PagedBlocks(kv, names, NB)
    lay = layout_for(kind, paged)
    assert page_shape_matches(lay, paged.page_shapes)
    out = torch.empty(len(PICK), paged.block_bytes, dtype=torch.uint8)
    paged.gather(PICK, out)
    shape = codec_layout.parse(lay)                      # understood, not refused
    for row, block in zip(out, PICK):
        parts = codec_layout.part_views(row.view(torch.bfloat16), shape)   # [L, T, H, D] each
        for layer, name in enumerate(names):
            for part, src in zip(parts, kv_of(kind, kv[name], block)):
                assert torch.equal(part[layer], src)
        # and a lossy codec keeps each value close to its source (per-token FP8 scales)
        codec_id, payload = encode_block("fp8", row, lay)
        assert codec_id != 0 and payload.nbytes < row.numel()
        back = codec_layout.part_views(decode_block(codec_id, payload, lay).view(torch.bfloat16), shape)
        for layer, name in enumerate(names):
            for part, src in zip(back, kv_of(kind, kv[name], block)):
                err = (part[layer].float() - src.float()).abs().max() / src.float().abs().max()
                assert err < 0.07, (kind, layer, float(err))


def test_a_backend_with_other_pages_is_refused_by_the_worker_check():
    g = torch.Generator().manual_seed(4)
    hnd = {f"layer.{i}": torch.randn(NB, 2, H, BS, D, generator=g).to(torch.bfloat16) for i in range(LAYERS)}
    paged = PagedBlocks(hnd, list(hnd), NB)
    lay = KVLayout(model="m", num_layers=LAYERS, num_kv_heads=H, head_dim=D, dtype="bfloat16", block_tokens=BS,
                   layout=layout_name("cuda"), block_bytes=paged.block_bytes)
    assert paged.page_shapes[0] == (2, H, BS, D)
    assert not page_shape_matches(lay, paged.page_shapes)


def test_cpu_and_gpu_blocks_are_named_apart():
    assert layout_name("cpu") == "vllm_cpu"
    assert layout_name("cuda") == layout_name("xpu") == "layer,kv,token,head,dim"
    assert layout_name("cuda", mla=True) == "layer,token,dim"

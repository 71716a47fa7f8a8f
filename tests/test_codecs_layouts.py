"""Codecs on every engine layout: synthetic KV in each engine's exact memory layout, cut into blocks
the way its connector cuts them, round trips within each codec's stated error; layouts codecs do
not understand stay raw, with a reason.

Each engine case below is written from the engine's own description of its memory (vLLM's per-layer
paged tensors and the connector's per-block gather, SGLang's host-pool dims and
``get_page_buffer_meta`` segments, LMCache's MP object shape), independently of
``kvstore.codecs.layout``: a block is cut from the engine tensors, encoded, decoded and written back
into a copy of them, and K, V or the latent are compared where the engine keeps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch

import kvstore.codecs.base as codec_base
from kvstore.codecs import (CODEC_IDS, REASONS, Refused, check_layout, compiled_on_cpu, decode_block, encode_block,
                            reason_of, warm_up)
from kvstore.errors import CodecError
from kvstore.keys import KVLayout

LOSSY = ["fp8", "fp8_head", "int4_g32", "int4_g64", "int4_g128", "int4_g64_k16", "int8", "int8_had", "int4_g64_k16_had",
         "int8_kchan", "int4_g64_t0"]
L, T, H, D = 3, 16, 2, 64        # layers, tokens per block / page, KV heads, head_dim
LATENT = 80                      # MLA kv_lora_rank + rope dims (64 + 16)
BLOCKS = 3                       # blocks (pages) per engine tensor; the middle one is checked
BF16 = torch.bfloat16


def spread(x: torch.Tensor) -> torch.Tensor:
    """Magnitudes that differ along the two axes before the last (heads, tokens, layers), so a
    block read with its axes confused is quantised in the wrong groups and fails the error bound."""
    a = torch.arange(x.shape[-2], dtype=torch.float32)
    b = torch.arange(x.shape[-3], dtype=torch.float32)
    return x * (1 + (a % 5) * 3)[:, None] * (1 + (b % 3) * 7)[:, None, None]


def keys_like(*shape: int, seed: int) -> torch.Tensor:
    """Keys: a few outlier channels (large, biased) on the last axis."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :max(1, shape[-1] // 32)] = x[..., :max(1, shape[-1] // 32)] * 4 + 20
    return spread(x).to(BF16)


def values_like(*shape: int, seed: int) -> torch.Tensor:
    """Values: magnitudes varying per row (token)."""
    g = torch.Generator().manual_seed(seed)
    return spread(torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).mul(3).add(0.1)).to(BF16)


@dataclasses.dataclass
class Engine:
    """One engine layout: its tensors, the blocks its connector stores, where K/V/latent live."""

    layout: KVLayout
    state: list[torch.Tensor]                                          # the engine's KV tensors
    pages: Callable[[list[torch.Tensor]], list[list[torch.Tensor]]]    # per stored block: the views it is cut from
    tensors: Callable[[list[torch.Tensor], int], list[tuple[str, torch.Tensor]]]  # block i -> (role, [L,T,H,D])

    def clone(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.state]

    def blocks(self, state: list[torch.Tensor]) -> list[torch.Tensor]:
        """The stored blocks: each block's views back to back (a copy)."""
        return [torch.cat([p.contiguous().view(-1) for p in views]) for views in self.pages(state)]

    def scatter(self, state: list[torch.Tensor], i: int, block: torch.Tensor) -> None:
        """Write block ``i`` back where it was cut from, as the connector's load does."""
        offset = 0
        for view in self.pages(state)[i]:
            view.copy_(block[offset:offset + view.numel()].view(view.shape))
            offset += view.numel()


def layout(name: str, *, layers=L, heads=H, dim=D, tokens=T, kv=2, block_bytes=0) -> KVLayout:
    return KVLayout("test/engine", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="bfloat16",
                    block_tokens=tokens, layout=name, kv_per_token=kv, block_bytes=block_bytes)


# --- vLLM: one paged tensor per layer; the connector stores a block as every layer's page for it,
#     back to back, each page in the layer tensor's logical order with the block axis removed -----

def vllm_engine(kind: str) -> Engine:
    if kind == "mla":   # [num_blocks, block_size, kv_lora_rank + rope_dim] per layer
        state = [keys_like(BLOCKS, T, LATENT, seed=l) for l in range(L)]
        return Engine(layout("layer,token,dim", heads=1, dim=LATENT, kv=1), state,
                      lambda s: [[c[b] for c in s] for b in range(BLOCKS)],
                      lambda s, b: [("k", torch.stack([c[b] for c in s])[:, :, None, :])])
    k = [keys_like(BLOCKS, T, H, D, seed=l) for l in range(L)]
    v = [values_like(BLOCKS, T, H, D, seed=10 + l) for l in range(L)]
    if kind == "flash_attn":   # [2, num_blocks, block_size, kv_heads, head_size]
        state = [torch.stack((kl, vl)) for kl, vl in zip(k, v)]
        return Engine(layout("layer,kv,token,head,dim"), state,
                      lambda s: [[c[:, b] for c in s] for b in range(BLOCKS)],
                      lambda s, b: [("k", torch.stack([c[0, b] for c in s])), ("v", torch.stack([c[1, b] for c in s]))])
    if kind == "flashinfer":   # [num_blocks, 2, block_size, kv_heads, head_size]
        state = [torch.stack((kl, vl), dim=1) for kl, vl in zip(k, v)]
        return Engine(layout("layer,kv,token,head,dim"), state,
                      lambda s: [[c[b] for c in s] for b in range(BLOCKS)],
                      lambda s, b: [("k", torch.stack([c[b, 0] for c in s])), ("v", torch.stack([c[b, 1] for c in s]))])
    # kind == "lbhnc": vLLM's [L, B, H, N, C] caches: per layer [num_blocks, heads, tokens, K dims | V dims]
    state = [torch.cat((kl, vl), dim=-1).permute(0, 2, 1, 3).contiguous() for kl, vl in zip(k, v)]
    return Engine(layout("layer,head,token,kv,dim"), state,
                  lambda s: [[c[b] for c in s] for b in range(BLOCKS)],
                  lambda s, b: [("k", torch.stack([c[b, :, :, :D].transpose(0, 1) for c in s])),
                                ("v", torch.stack([c[b, :, :, D:].transpose(0, 1) for c in s]))])


# --- SGLang host pools (pool_host/mha.py, mla.py: init_kv_buffer dims, get_page_buffer_meta) ------

SGLANG_MHA = ("layer_first", "page_first", "page_first_direct", "page_head")
SGLANG_MLA = ("layer_first", "page_first", "page_first_direct")


def sglang_mha(pool_layout: str) -> Engine:
    size = BLOCKS * T
    k, v = keys_like(L, size, H, D, seed=1), values_like(L, size, H, D, seed=2)   # logical [layer, token, head, dim]
    logical = torch.stack((k, v))                                                  # [2, L, size, H, D]
    pages = logical.view(2, L, BLOCKS, T, H, D)
    buffer = {"layer_first": logical,                                         # (2, L, size, H, D)
              "page_first": logical.permute(0, 2, 1, 3, 4),                   # (2, size, L, H, D)
              "page_first_direct": pages.permute(0, 2, 1, 3, 4, 5),           # (2, page_num, L, page, H, D)
              "page_head": pages.permute(0, 2, 4, 3, 1, 5)}[pool_layout]      # (2, page_num, H, page, L, D)
    state = [buffer.contiguous()]

    def segments(s):
        buf = s[0]
        if pool_layout == "layer_first":   # per page: K and V of each layer, [page, H, D] each
            return [[buf[kv, l, q * T:(q + 1) * T]] for q in range(BLOCKS) for l in range(L) for kv in (0, 1)]
        if pool_layout == "page_first":    # per page: K, V [page tokens, L, H, D]
            return [[buf[kv, q * T:(q + 1) * T]] for q in range(BLOCKS) for kv in (0, 1)]
        return [[buf[kv, q]] for q in range(BLOCKS) for kv in (0, 1)]

    def tensors(s, i):
        buf = s[0]
        if pool_layout == "layer_first":
            q, rest = divmod(i, 2 * L)
            l, kv = divmod(rest, 2)
            return [("k", buf[kv, l, q * T:(q + 1) * T][None])]
        q, kv = divmod(i, 2)
        if pool_layout == "page_first":
            return [("k", buf[kv, q * T:(q + 1) * T].transpose(0, 1))]
        if pool_layout == "page_first_direct":
            return [("k", buf[kv, q])]
        return [("k", buf[kv, q].permute(2, 1, 0, 3))]                       # [H, page, L, D] -> [L, page, H, D]

    per_page = 2 * L if pool_layout == "layer_first" else 2
    seg_bytes = state[0].numel() * 2 // (BLOCKS * per_page)
    return Engine(layout(f"sglang_{pool_layout}_segment{per_page}", block_bytes=seg_bytes), state, segments, tensors)


def sglang_mla(pool_layout: str) -> Engine:
    size = BLOCKS * T
    latent = keys_like(L, size, LATENT, seed=3)                                     # logical [layer, token, dim]
    pages = latent.view(L, BLOCKS, T, LATENT)
    buffer = {"layer_first": latent[:, :, None, :],                          # (L, size, 1, D)
              "page_first": latent.transpose(0, 1)[:, :, None, :],           # (size, L, 1, D)
              "page_first_direct": pages.transpose(0, 1)[:, :, :, None, :]}[pool_layout]  # (page_num, L, page, 1, D)
    state = [buffer.contiguous()]

    def segments(s):
        buf = s[0]
        if pool_layout == "layer_first":
            return [[buf[l, q * T:(q + 1) * T]] for q in range(BLOCKS) for l in range(L)]
        if pool_layout == "page_first":
            return [[buf[q * T:(q + 1) * T]] for q in range(BLOCKS)]
        return [[buf[q]] for q in range(BLOCKS)]

    def tensors(s, i):
        buf = s[0]
        if pool_layout == "layer_first":
            q, l = divmod(i, L)
            return [("k", buf[l, q * T:(q + 1) * T][None])]                  # [1, page, 1, D]
        if pool_layout == "page_first":
            return [("k", buf[i * T:(i + 1) * T].transpose(0, 1))]           # [L, page, 1, D]
        return [("k", buf[i])]                                                # [L, page, 1, D]

    per_page = L if pool_layout == "layer_first" else 1
    seg_bytes = state[0].numel() * 2 // (BLOCKS * per_page)
    return Engine(layout(f"sglang_mla_{pool_layout}_segment{per_page}", heads=1, dim=LATENT, kv=1,
                         block_bytes=seg_bytes), state, segments, tensors)


# --- LMCache MP objects: [2, layers, tokens, hidden] (hidden = heads x head_dim) or [layers, tokens, hidden] --

def lmcache_engine(kind: str) -> Engine:
    if kind == "mla":
        state = [keys_like(BLOCKS, L, T, LATENT, seed=4)]
        return Engine(layout("layer,token,dim", heads=1, dim=LATENT, kv=1), state,
                      lambda s: [[s[0][i]] for i in range(BLOCKS)], lambda s, i: [("k", s[0][i][:, :, None, :])])
    objs = torch.stack((keys_like(BLOCKS, L, T, H * D, seed=5), values_like(BLOCKS, L, T, H * D, seed=6)), dim=1)
    return Engine(layout("kv,layer,token,dim", heads=1, dim=H * D), [objs],
                  lambda s: [[s[0][i]] for i in range(BLOCKS)],
                  lambda s, i: [("k", s[0][i, 0][:, :, None, :]), ("v", s[0][i, 1][:, :, None, :])])


ENGINES = {
    **{f"vllm_{k}": (lambda k=k: vllm_engine(k)) for k in ("flash_attn", "flashinfer", "lbhnc", "mla")},
    **{f"sglang_mha_{p}": (lambda p=p: sglang_mha(p)) for p in SGLANG_MHA},
    **{f"sglang_mla_{p}": (lambda p=p: sglang_mla(p)) for p in SGLANG_MLA},
    **{f"lmcache_{k}": (lambda k=k: lmcache_engine(k)) for k in ("kv", "mla")},
}


def rotated(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., D] with each group of n dims times H_n / n (Sylvester's Hadamard matrix, built
    here), n the largest power of two dividing D up to 64; and n."""
    n = 1
    while n < 64 and x.shape[-1] % (2 * n) == 0:
        n *= 2
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (x.reshape(*x.shape[:-1], -1, n) @ (h / n)).reshape(x.shape), n


def error_bound(codec: str, x: torch.Tensor, y: torch.Tensor, role: str) -> torch.Tensor:
    """The codec's stated elementwise error for ``x`` ([L, T, H, D], float) decoded as ``y``: fp8
    half an e4m3 step of each (token, head) row's (or head's) scale; int8 half a step of each row's
    scale (int8_kchan's keys and one-tensor blocks: of each channel's); int4 half a step of the group
    range, keys (and one-tensor blocks) per channel over the block's tokens, values per token; a
    rotated row (int8_had's keys and one-tensor blocks, every int4_g64_k16_had row) n half steps of
    the rotated row."""
    eps = torch.finfo(BF16).eps
    if codec.startswith("int8"):
        # (int8_kchan: keys and one-tensor blocks per channel over the block's tokens)
        dim = 1 if codec == "int8_kchan" and role == "k" else 3
        plain = x.abs().amax(dim=dim, keepdim=True) / 127 / 2 * (1 + 2 ** -7) + y.abs() * eps
        if codec in ("int8", "int8_kchan"):
            return plain
        r, n = rotated(x)   # (a V-only segment is rotated as a one-tensor block: either bound)
        return torch.maximum(plain, r.abs().amax(dim=3, keepdim=True) / 127 / 2 * (1 + 2 ** -7) * n * (1 + 1e-5)
                             + y.abs() * eps)
    if codec.startswith("fp8"):
        amax = x.abs().amax(dim=(1, 3) if codec == "fp8_head" else (3,), keepdim=True)
        return x.abs() / 16 + amax / 448 * 2 ** -9 * 1.01 + y.abs() * eps
    if codec == "int4_g64_t0":   # token 0 exact, the other tokens int4_g64 over them alone
        return torch.cat((y[:, :1].abs() * eps, error_bound("int4_g64", x[:, 1:], y[:, 1:], role)), 1)
    group = int(codec.split("_g")[1].split("_")[0])
    nl, nt, nh, nd = x.shape
    r, n = rotated(x) if codec.endswith("_had") else (x, 1)
    if role == "k":
        g = min(int(codec.split("_k")[1].split("_")[0]) if "_k" in codec else group, nt)
        xg = r.reshape(nl, nt // g, g, nh, nd)
        rng = (xg.amax(2, keepdim=True) - xg.amin(2, keepdim=True)).expand_as(xg).reshape(x.shape)
    else:
        g = min(group, nd)
        xg = r.reshape(nl, nt, nh, nd // g, g)
        rng = (xg.amax(4, keepdim=True) - xg.amin(4, keepdim=True)).expand_as(xg).reshape(x.shape)
    return (rng / 15 / 2 * (1 + 4 * eps) + rng * 4 * eps) * n + y.abs() * eps


def round_trip(engine: Engine, codec: str) -> list[torch.Tensor]:
    """Every block encoded and decoded back into a copy of the engine's tensors; returns the copy."""
    decoded = engine.clone()
    for fill in decoded:
        fill.fill_(float("nan"))   # every element must be written back by some block
    for i, src in enumerate(engine.blocks(engine.state)):
        raw = src.view(torch.uint8)
        assert raw.numel() == engine.layout.block_bytes
        cid, payload = encode_block(codec, raw, engine.layout)
        assert cid == CODEC_IDS[codec]
        if codec != "zstd":
            assert payload.nbytes < raw.numel()
        out = torch.empty(engine.layout.block_bytes, dtype=torch.uint8)
        decode_block(cid, payload, engine.layout, out=out)
        engine.scatter(decoded, i, out.view(BF16))
    assert not any(bool(t.isnan().any()) for t in decoded)
    return decoded


@pytest.mark.parametrize("codec", LOSSY + ["zstd"])
@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_engine_layout_round_trips_within_the_codecs_error(engine_name, codec):
    engine = ENGINES[engine_name]()
    check_layout(codec, engine.layout)
    decoded = round_trip(engine, codec)
    n_blocks = len(engine.blocks(engine.state))
    for i in range(n_blocks):
        for (role, want), (_, got) in zip(engine.tensors(engine.state, i), engine.tensors(decoded, i)):
            if codec == "zstd":
                assert torch.equal(got, want)
                continue
            x, y = want.float(), got.float()
            err = (y - x).abs()
            assert bool((err <= error_bound(codec, x, y, role)).all()), (i, role, float(err.max()))
            rel = ((y - x).norm() / x.norm()).item()
            assert rel < (0.04 if codec.startswith("fp8") else 0.12), (i, role, rel)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_engine_layout_compiled_kernels_match_the_reference(engine_name, codec, monkeypatch):
    """The compiled CPU kernels (numba) give the torch reference's bytes on every engine layout."""
    pytest.importorskip("numba")
    engine = ENGINES[engine_name]()
    warm_up()   # (until the kernels are compiled, the codecs run the reference)
    assert compiled_on_cpu(codec, engine.layout)
    for block in engine.blocks(engine.state)[:2]:
        raw = block.view(torch.uint8)
        monkeypatch.setattr(codec_base, "USE_FAST", False)
        ref = encode_block(codec, raw, engine.layout)[1]
        ref_out = decode_block(CODEC_IDS[codec], ref, engine.layout)
        monkeypatch.setattr(codec_base, "USE_FAST", True)
        fast = encode_block(codec, raw, engine.layout)[1]
        assert np.array_equal(ref, fast)
        assert torch.equal(decode_block(CODEC_IDS[codec], fast, engine.layout), ref_out)


def test_an_mla_latent_gets_one_fp8_scale_per_token():
    """vLLM MLA pages: the fp8 payload holds one byte per element and one bf16 scale per token."""
    engine = ENGINES["vllm_mla"]()
    block = engine.blocks(engine.state)[0].view(torch.uint8)
    _, payload = encode_block("fp8", block, engine.layout)
    codes, scales = L * T * LATENT, L * T * 2
    assert payload.nbytes == 48 + codes + (-codes % 16) + scales + (-scales % 16)


@pytest.mark.parametrize("codec", LOSSY)
def test_nan_in_a_one_tensor_block_is_refused_with_a_reason(codec):
    engine = ENGINES["sglang_mha_page_first"]()
    block = engine.blocks(engine.state)[1]
    block[7] = float("nan")
    with pytest.raises(CodecError, match="NaN or Inf") as e:
        encode_block(codec, block.view(torch.uint8), engine.layout)
    assert reason_of(e.value) == "nonfinite"


# --- layouts codecs do not understand stay raw, and say why -------------------------------------

@pytest.mark.parametrize("kwargs, reason", [
    (dict(name="vllm_cuda"), "unknown_layout"),                       # a GPU connector that names no axes
    (dict(name="opaque"), "unknown_layout"),
    (dict(name="layer,kv,token,head"), "unknown_layout"),              # no dim axis
    (dict(name="lmcache_mp_object"), "unknown_layout"),
    (dict(name="sglang_page_unified_segment2"), "unknown_layout"),
    (dict(name="sglang_page_first_segment3"), "segment_count"),
    (dict(name="sglang_layer_first_segment2"), "segment_count"),       # layer_first has 2 x layers
    (dict(name="vllm_cpu", kv=1), "mla_kv_axis"),
    (dict(name="layer,kv,token,dim", kv=1, heads=1), "mla_kv_axis"),
    (dict(name="layer,kv,token,head,dim", block_bytes=L * 2 * T * H * D * 2 + 64), "padded"),
    (dict(name="layer,token,head,dim", block_bytes=L * 2 * T * H * D * 2), "padded"),   # one tensor, K+V bytes
    (dict(name="layer,kv,token,head,dim", kv=3), "kv_per_token"),
])
@pytest.mark.parametrize("codec", LOSSY)
def test_layouts_not_understood_stay_raw_with_a_reason(codec, kwargs, reason):
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    lay = layout(name, **kwargs)
    with pytest.raises(Refused) as e:
        check_layout(codec, lay)
    assert e.value.reason == reason and reason in REASONS
    with pytest.raises(CodecError):
        encode_block(codec, bytes(lay.block_bytes), lay)
    cid, payload = encode_block("zstd", bytes(lay.block_bytes), lay)   # lossless: any layout
    assert bytes(decode_block(cid, payload, lay).numpy()) == bytes(lay.block_bytes)


def test_fp8_kv_caches_stay_raw():
    lay = KVLayout("test/engine", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float8_e4m3fn",
                   block_tokens=T, layout="layer,kv,token,head,dim")
    with pytest.raises(Refused) as e:
        check_layout("fp8", lay)
    assert e.value.reason == "dtype"


def test_int4_group_refusals_carry_a_reason():
    with pytest.raises(Refused) as e:
        check_layout("int4_g32", layout("layer,kv,token,head,dim", tokens=48))
    assert e.value.reason == "group"
    # one-tensor blocks have no value groups: a head_dim the value group does not divide is fine
    check_layout("int4_g64", layout("layer,token,dim", heads=1, dim=80, kv=1))


def test_a_codec_that_would_not_shrink_a_layout_refuses_it_up_front():
    """SGLang's default page is one token: INT4 per channel over one token stores more statistics
    than data. check_layout says so once per namespace (encode_block itself still encodes)."""
    one_token = layout("sglang_page_first_segment2", tokens=1, block_bytes=L * H * D * 2)
    with pytest.raises(Refused) as e:
        check_layout("int4_g64", one_token)
    assert e.value.reason == "no_gain"
    check_layout("fp8", one_token)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("engine_name", ["vllm_lbhnc", "vllm_mla", "sglang_mha_layer_first", "sglang_mla_page_first",
                                         "lmcache_kv"])
def test_engine_layouts_do_not_depend_on_device_arithmetic(engine_name, codec, monkeypatch):
    """The CPU twin of tests/test_codecs_cuda.py for engine layouts: the torch reference with CUDA's
    division semantics and one-kernel reductions gives the plain reference's bytes."""
    from kvstore.codecs import exact
    from test_codecs import CudaScalarDivision, reference_payload

    engine = ENGINES[engine_name]()
    raw = engine.blocks(engine.state)[1].view(torch.uint8)
    plain = reference_payload(codec, raw, engine.layout, monkeypatch)
    mode = CudaScalarDivision()
    assert np.array_equal(plain, reference_payload(codec, raw, engine.layout, monkeypatch, mode))
    assert mode.scalar_divisions == []
    monkeypatch.setattr(exact, "one_kernel_reductions", lambda device: True)
    assert np.array_equal(plain, reference_payload(codec, raw, engine.layout, monkeypatch))

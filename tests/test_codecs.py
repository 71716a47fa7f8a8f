"""Codecs: round trips in every layout, error bounds, known answers, and refusals of bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs import (CODEC_IDS, Refused, check_layout, check_payload, codec_for_id, compiled_on_cpu,
                            decode_block, encode_block, get_codec, warm_up)
from kvstore.codecs.header import HEADER_BYTES
from kvstore.errors import CodecError, KVStoreError
from kvstore.keys import KVLayout

AXES = ("kv", "layer", "token", "head", "dim")
LAYOUTS = ["kv,layer,token,head,dim", "kv,token,layer,head,dim", "kv,head,token,layer,dim",
           "layer,kv,token,head,dim", "vllm_cpu"]
LOSSY = ["fp8", "fp8_head", "int4_g32", "int4_g64", "int4_g128", "int4_g64_k16", "int8", "int8_had", "int4_g64_k16_had",
         "int8_kchan", "int4_g64_t0"]
ROTATED = ("int8_had", "int4_g64_k16_had")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_layout(layout="kv,layer,token,head,dim", L=2, T=32, H=2, D=64, dtype="bfloat16", **kw):
    return KVLayout("test/model", num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype,
                    block_tokens=T, layout=layout, **kw)


def pack_block(k: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """Reference packing of K, V [L, T, H, D] into a flat block, written independently of
    kvstore.codecs.layout (from the layout descriptions)."""
    if layout == "vllm_cpu":
        L, T, H, D = k.shape
        per_head = [torch.cat((k[l, :, h, :].T.reshape(-1), v[l, :, h, :].reshape(-1)))
                    for l in range(L) for h in range(H)]
        return torch.cat(per_head)
    kv = torch.stack((k, v))  # kv, layer, token, head, dim
    return kv.permute(*(AXES.index(a) for a in layout.split(","))).contiguous().reshape(-1)


def unpack_block(block: torch.Tensor, layout: str, L, T, H, D) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "vllm_cpu":
        b = block.view(L, H, 2, D * T)
        k = b[:, :, 0].reshape(L, H, D, T).permute(0, 3, 1, 2)
        v = b[:, :, 1].reshape(L, H, T, D).permute(0, 2, 1, 3)
        return k, v
    sizes = dict(kv=2, layer=L, token=T, head=H, dim=D)
    order = layout.split(",")
    kv = block.view(*(sizes[a] for a in order)).permute(*(order.index(a) for a in AXES))
    return kv[0], kv[1]


def realistic_kv(L, T, H, D, dtype=torch.bfloat16, seed=0):
    """Keys with a few outlier channels (large, biased), values varying per token."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, T, H, D, generator=g)
    outliers = torch.randperm(D, generator=g)[:max(1, D // 32)]
    k[..., outliers] = k[..., outliers] * 4 + 20 * torch.sign(torch.randn(len(outliers), generator=g))
    v = torch.randn(L, T, H, D, generator=g) * torch.rand(L, T, H, 1, generator=g).mul(3).add(0.1)
    return k.to(dtype), v.to(dtype)


def as_bytes(block: torch.Tensor) -> bytes:
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def roundtrip(codec, block: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    cid, payload = encode_block(codec, as_bytes(block), layout)
    assert cid == CODEC_IDS[codec]
    return decode_block(cid, payload, layout).view(block.dtype)


# --- the API contract -------------------------------------------------------------------------

def test_codec_ids_are_pinned():
    # Stored blocks name their codec by id: these numbers may never change.
    assert CODEC_IDS == {"raw": 0, "fp8": 1, "fp8_head": 2, "int4_g32": 3, "int4_g64": 4,
                         "int4_g128": 5, "zstd": 6, "int4_g64_k16": 7, "int8": 8, "int8_had": 9,
                         "int4_g64_k16_had": 10, "int8_kchan": 11, "int4_g64_t0": 12}
    for name, cid in CODEC_IDS.items():
        assert get_codec(name) is codec_for_id(cid) is get_codec(cid)


def test_unknown_codec_id_and_name_raise_codec_error_naming_them():
    with pytest.raises(CodecError, match="unknown codec id 99"):
        codec_for_id(99)
    with pytest.raises(CodecError, match="unknown codec id 99"):
        decode_block(99, b"x" * 10, make_layout())
    with pytest.raises(CodecError, match="'int3'"):
        encode_block("int3", b"", make_layout())
    assert issubclass(CodecError, KVStoreError)


def test_raw_is_identity_and_zero_copy():
    layout = make_layout()
    block = np.random.default_rng(0).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    cid, payload = encode_block("raw", block, layout)
    assert cid == 0 and np.shares_memory(payload, block)
    assert bytes(decode_block(0, payload, layout).numpy()) == block.tobytes()


@pytest.mark.parametrize("codec", list(CODEC_IDS))
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_every_codec_round_trips_in_every_layout(codec, layout_name):
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(layout_name, L, T, H, D)
    k, v = realistic_kv(L, T, H, D)
    out = roundtrip(codec, pack_block(k, v, layout_name), layout)
    k2, v2 = unpack_block(out, layout_name, L, T, H, D)
    if not get_codec(codec).lossy:
        assert torch.equal(k2, k) and torch.equal(v2, v)
        return
    for name, a, b in (("K", k, k2), ("V", v, v2)):
        rel = ((b.float() - a.float()).norm() / a.float().norm()).item()
        assert rel < (0.04 if codec.startswith("fp8") else 0.12), (name, rel)


@pytest.mark.parametrize("codec", LOSSY)
def test_layout_changes_byte_order_not_quantisation(codec):
    """The same K/V stored in different layouts encodes to the same payload and decodes to the
    same K/V: codecs quantise the real K and V axes, whatever the byte order."""
    L, T, H, D = 3, 32, 2, 32
    k, v = realistic_kv(L, T, H, D, seed=1)
    payloads, decoded = [], []
    for name in LAYOUTS:
        layout = make_layout(name, L, T, H, D)
        cid, p = encode_block(codec, as_bytes(pack_block(k, v, name)), layout)
        payloads.append(bytes(p[HEADER_BYTES:]))
        out = decode_block(cid, p, layout).view(torch.bfloat16)
        decoded.append(unpack_block(out, name, L, T, H, D))
    assert all(p == payloads[0] for p in payloads)
    for k2, v2 in decoded:
        assert torch.equal(k2, decoded[0][0]) and torch.equal(v2, decoded[0][1])


def sylvester(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix by Sylvester's construction (entries +-1), built here from its
    definition, independently of kvstore.codecs.rotation."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rotated(x: torch.Tensor, n: int = 64) -> torch.Tensor:
    """x [..., D] with each group of n dims multiplied by H_n / n (what the rotated codecs quantise)."""
    return (x.reshape(*x.shape[:-1], -1, n) @ (sylvester(n) / n)).reshape(x.shape)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("codec", LOSSY)
def test_elementwise_error_bounds(codec, dtype):
    """Every element is within the codec's quantisation step of the input (plus output rounding);
    a rotated row within n steps of the rotated row (rotating back sums n errors)."""
    L, T, H, D = 2, 32, 4, 64
    layout = make_layout(L=L, T=T, H=H, D=D, dtype=dtype)
    k, v = realistic_kv(L, T, H, D, TORCH_DTYPES[dtype], seed=2)
    out = roundtrip(codec, pack_block(k, v, layout.layout), layout)
    k2, v2 = unpack_block(out, layout.layout, L, T, H, D)
    eps = torch.finfo(TORCH_DTYPES[dtype]).eps
    for x, x2, is_key in ((k.float(), k2.float(), True), (v.float(), v2.float(), False)):
        err = (x2 - x).abs()
        if codec.startswith("int8"):   # half a step of each (token, head) row's amax / 127
            rot = codec == "int8_had" and is_key   # (int8_had rotates keys only)
            # (int8_kchan: of each key channel's amax over the block's tokens)
            amax = (rotated(x) if rot else x).abs().amax(dim=1 if codec == "int8_kchan" and is_key else 3,
                                                         keepdim=True)
            # (the scale is rounded up to bf16: up to 2**-8 coarser than amax / 127)
            half_step = amax / 127 / 2 * (1 + 2 ** -7)
            assert bool((err <= half_step * (D if rot else 1) * (1 + 1e-5) + x2.abs() * eps).all())
            continue
        if codec.startswith("fp8"):
            dims = (1, 3) if codec == "fp8_head" else (3,)
            amax = x.abs().amax(dim=dims, keepdim=True)
            # e4m3 rounds to 3 mantissa bits: half an ulp is 1/16 of the value; subnormals
            # have a fixed spacing of amax/448 * 2^-9.
            bound = x.abs() / 16 + amax / 448 * 2 ** -9 * 1.01 + x2.abs() * eps
        else:
            groups = codec.split("_")
            group = int(groups[1][1:])
            key_group = int(groups[2][1:]) if len(groups) > 2 and groups[2].startswith("k") else group
            rot = codec in ROTATED
            if is_key:  # per channel (of the rotated rows), groups of min(key group, T) tokens
                g = min(key_group, T)
                xg = (rotated(x) if rot else x).view(L, T // g, g, H, D)
                rng = (xg.amax(2, keepdim=True) - xg.amin(2, keepdim=True)).expand_as(xg).reshape(x.shape)
            else:       # per token, groups of min(group, D) dims (of the rotated row)
                g = min(group, D)
                xg = (rotated(x) if rot else x).view(L, T, H, D // g, g)
                rng = (xg.amax(4, keepdim=True) - xg.amin(4, keepdim=True)).expand_as(xg).reshape(x.shape)
            # half a step, a little slack for the stored scale being rounded up to the
            # block's dtype, plus the output's own rounding
            bound = (rng / 15 / 2 * (1 + 4 * eps) + rng * 4 * eps) * (D if rot else 1) + x2.abs() * eps
        if codec == "int4_g64_t0":   # token 0 exact; the other tokens as int4 over them alone
            xr = x[:, 1:]
            if is_key:
                rng = (xr.amax(1, keepdim=True) - xr.amin(1, keepdim=True)).expand_as(xr)
            else:
                xg = xr.view(L, T - 1, H, 1, D)
                rng = (xg.amax(4, keepdim=True) - xg.amin(4, keepdim=True)).expand_as(xg).reshape(xr.shape)
            bound = torch.cat((torch.zeros_like(x[:, :1]), rng / 15 / 2 * (1 + 4 * eps) + rng * 4 * eps), 1)
            bound = bound + x2.abs() * eps
        assert bool((err <= bound).all()), float((err - bound).max())


# --- known answers ----------------------------------------------------------------------------

def test_int8_known_answer():
    """A row whose amax is 127 gets scale 1.0: integers decode exactly and encode to themselves."""
    L, T, H, D = 1, 1, 1, 8
    layout = make_layout(L=L, T=T, H=H, D=D)
    row = torch.tensor([127, -127, 3, 0, -1, 64, 5, -100])
    block = pack_block(row.view(1, 1, 1, D), (row * 2).view(1, 1, 1, D), layout.layout).to(torch.bfloat16)
    cid, payload = encode_block("int8", as_bytes(block), layout)
    codes = payload[HEADER_BYTES:HEADER_BYTES + 2 * D].view(np.int8)
    assert codes[:D].tolist() == row.tolist() and codes[D:].tolist() == row.tolist()
    scales = torch.from_numpy(payload[HEADER_BYTES + 16:HEADER_BYTES + 20].copy()).view(torch.bfloat16)
    assert scales.tolist() == [1.0, 2.0]
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


def test_int8_beats_fp8_at_the_same_size_on_rows_without_outliers():
    """int8 has FP8's bytes (a byte per element, a bf16 scale per row) and a uniform grid of
    amax / 127: on values (no outlier channels) its error is a fraction of e4m3's."""
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = realistic_kv(L, T, H, D, seed=30)
    block = pack_block(k, v, layout.layout)
    sizes = {c: len(encode_block(c, as_bytes(block), layout)[1]) for c in ("fp8", "int8")}
    assert sizes["fp8"] == sizes["int8"]
    errors = {}
    for codec in ("fp8", "int8"):
        _, v2 = unpack_block(roundtrip(codec, block, layout), layout.layout, L, T, H, D)
        errors[codec] = float((v2.float() - v.float()).norm() / v.float().norm())
    assert errors["int8"] * 3 < errors["fp8"], errors


def test_int4_g64_k16_groups_keys_over_16_tokens():
    """Keys per channel over 16 tokens (values per token over 64 dims, as int4_g64): twice
    int4_g64's key statistics, and both group sizes in the header's parameter."""
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    block = as_bytes(pack_block(*realistic_kv(L, T, H, D, seed=31), layout.layout))
    p16, p64 = encode_block("int4_g64_k16", block, layout)[1], encode_block("int4_g64", block, layout)[1]
    key_stats = L * H * D * 2 * 2   # scale + min per (layer, head, channel) per 32 tokens, 2 bytes each
    assert len(p16) - len(p64) == key_stats
    assert int.from_bytes(bytes(p16[8:10]), "little") == 64 + 256 * 16
    k = pack_block(*realistic_kv(L, T, H, D, seed=31), layout.layout)
    k[:L * T * H * D].view(L, T, H, D)[:, :16] *= 40   # the first 16 tokens far larger
    errs = {}
    for codec in ("int4_g64", "int4_g64_k16"):
        k2, _ = unpack_block(roundtrip(codec, k, layout), layout.layout, L, T, H, D)
        k1 = k[:L * T * H * D].view(L, T, H, D)
        errs[codec] = float((k2[:, 16:].float() - k1[:, 16:].float()).norm() / k1[:, 16:].float().norm())
    assert errs["int4_g64_k16"] * 5 < errs["int4_g64"], errs


@pytest.mark.parametrize("codec", ROTATED)
def test_rotated_codecs_known_answer(codec):
    """Key rows holding 64 in dim 5 and zeros elsewhere rotate (H_64 / 64) to row 5 of H_64
    (+-1), value rows with 64 in dim 0 to 64 ones: int8_had stores the keys as codes +-126 in that
    row's signs (values unrotated: 126 then zeros), int4_g64_k16_had both as groups of range 0
    (codes 0); both decode to the block exactly."""
    L, T, H, D = 1, 32, 1, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = torch.zeros(L, T, H, D), torch.zeros(L, T, H, D)
    k[..., 5] = 64
    v[..., 0] = 64
    block = pack_block(k, v, layout.layout).to(torch.bfloat16)
    cid, payload = encode_block(codec, as_bytes(block), layout)
    body = payload[HEADER_BYTES:]
    if codec == "int8_had":
        codes = torch.from_numpy(body[:2 * T * D].view(np.int8).reshape(2, T, D).astype(np.float32))
        assert torch.equal(codes[0], 126 * sylvester(64)[5].expand(T, D))   # 126 = rint(1 / round_up_bf16(1 / 127))
        assert torch.equal(codes[1], 126 * torch.eye(D)[0].expand(T, D))
    else:
        n = T * D // 2   # K codes, then V codes (sections 16-byte aligned)
        assert not body[:n].any() and not body[n + (-n % 16):n + (-n % 16) + n].any()
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


def test_rotation_shrinks_the_error_of_outlier_channels():
    """Keys with outlier channels: the rotated codecs' error (L2, relative) is well below the
    unrotated ones' at the same size, on keys for int8_had (values are not rotated: the same
    error) and on values with a large channel for int4_g64_k16_had."""
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = realistic_kv(L, T, H, D, seed=40)
    v = v.float()
    v[..., 3] += 30   # a value channel far above the rest
    v = v.to(torch.bfloat16)
    block = pack_block(k, v, layout.layout)

    def errors(codec):
        k2, v2 = unpack_block(roundtrip(codec, block, layout), layout.layout, L, T, H, D)
        return [float((b.float() - a.float()).norm() / a.float().norm()) for a, b in ((k, k2), (v, v2))]
    raw = as_bytes(block)
    assert len(encode_block("int8_had", raw, layout)[1]) == len(encode_block("int8", raw, layout)[1])
    assert errors("int8_had")[0] * 2 < errors("int8")[0], (errors("int8_had"), errors("int8"))
    assert errors("int8_had")[1] == errors("int8")[1]
    assert errors("int4_g64_k16_had")[1] * 2 < errors("int4_g64_k16")[1], (errors("int4_g64_k16_had"),
                                                                          errors("int4_g64_k16"))


def test_int8_kchan_known_answer():
    """Keys get one scale per (layer, head, channel) over the block's tokens, values one per row:
    key channel d holding integers up to 127 * 2**d gets scale 2**d (its codes the integers, exact
    on decode), values as int8's rows; sections codes, key scales [L, H, D], value scales [L, T, H]."""
    L, T, H, D = 1, 4, 1, 8
    layout = make_layout(L=L, T=T, H=H, D=D)
    ints = torch.tensor([[127, -3, 0, 5, -127, 64, 1, 2], [-127, 3, 127, -5, 100, -64, 127, -2],
                         [1, 127, -1, 127, 0, 127, -127, 127], [0, 0, 2, 0, 127, 0, 0, 0]])   # [T, D]
    k = ints * 2.0 ** torch.arange(D)   # channel d scaled by 2**d
    v = ints.flip(0) * 0.5   # every row's amax 63.5: scale 0.5
    block = pack_block(k.view(1, T, 1, D), v.view(1, T, 1, D), layout.layout).to(torch.bfloat16)
    cid, payload = encode_block("int8_kchan", as_bytes(block), layout)
    assert cid == 11 and int.from_bytes(bytes(payload[8:10]), "little") == 0
    body = payload[HEADER_BYTES:]
    codes = body[:2 * T * D].view(np.int8).reshape(2, T, D)
    assert codes[0].tolist() == ints.tolist() and codes[1].tolist() == ints.flip(0).tolist()
    k_scales = torch.from_numpy(body[2 * T * D:2 * T * D + 2 * D].copy()).view(torch.bfloat16)
    assert k_scales.tolist() == (2.0 ** torch.arange(D)).tolist()
    v_scales = torch.from_numpy(body[2 * T * D + 16:2 * T * D + 16 + 2 * T].copy()).view(torch.bfloat16)
    assert v_scales.tolist() == [0.5] * T
    assert len(body) == 2 * T * D + 16 + 16   # codes, 8 key scales, 4 value scales (16-byte aligned)
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


def test_per_channel_key_scales_shrink_the_error_of_outlier_channels():
    """Keys with outlier channels: int8_kchan's key error (L2, relative) is far below int8's, at
    about int8's size; its values are int8's rows, so their codes, scales and error are int8's."""
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = realistic_kv(L, T, H, D, seed=41)
    block = pack_block(k, v, layout.layout)

    def errors(codec):
        k2, v2 = unpack_block(roundtrip(codec, block, layout), layout.layout, L, T, H, D)
        return [float((b.float() - a.float()).norm() / a.float().norm()) for a, b in ((k, k2), (v, v2))]
    raw = as_bytes(block)
    plain, kchan = encode_block("int8", raw, layout)[1], encode_block("int8_kchan", raw, layout)[1]
    assert len(plain) < len(kchan) <= len(plain) * 1.02
    assert errors("int8_kchan")[0] * 3 < errors("int8")[0], (errors("int8_kchan"), errors("int8"))
    assert errors("int8_kchan")[1] == errors("int8")[1]
    n = L * T * H * D   # V codes follow K codes in both
    assert bytes(kchan[HEADER_BYTES + n:HEADER_BYTES + 2 * n]) == bytes(plain[HEADER_BYTES + n:HEADER_BYTES + 2 * n])


def test_int4_g64_t0_known_answer():
    """Token 0 of every (layer, head) is stored as it is, after int4's sections for the other
    tokens: keys t % 16 along tokens 1.. and values i % 16 along dims are exact on the 16-level grid
    (codes predictable), token 0's rows (far off that grid) decode bit for bit."""
    L, T, H, D = 1, 17, 1, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k = ((torch.arange(T) - 1) % 16).float().view(1, T, 1, 1).expand(L, T, H, D).clone()
    v = (torch.arange(D) % 16).float().view(1, 1, 1, D).expand(L, T, H, D).clone()
    k[:, 0], v[:, 0] = torch.linspace(-900, 1234.5, D), torch.linspace(3e-3, -7.25, D)
    block = pack_block(k, v, layout.layout).to(torch.bfloat16)
    cid, payload = encode_block("int4_g64_t0", as_bytes(block), layout)
    assert cid == 12 and int.from_bytes(bytes(payload[8:10]), "little") == 64
    body = payload[HEADER_BYTES:]
    n = (T - 1) * D // 2   # K codes, then V codes (16-byte aligned)
    k_codes = body[:n].reshape(T - 1, D // 2)
    v_codes = body[n:2 * n].reshape(T - 1, D // 2)
    assert [row[0] for row in k_codes.tolist()] == [(t % 16) * 0x11 for t in range(T - 1)]
    assert v_codes[0].tolist() == [(2 * i % 16) | ((2 * i + 1) % 16) << 4 for i in range(D // 2)]
    stats = 2 * D * 2 + 2 * (T - 1) * 2   # K scale + min per channel, V scale + min per row (bf16)
    first = torch.from_numpy(body[2 * n + stats:].copy()).view(torch.bfloat16).view(2, D)
    assert len(body) == 2 * n + stats + 2 * 2 * D
    assert torch.equal(first[0], block.view(2, T, D)[0, 0]) and torch.equal(first[1], block.view(2, T, D)[1, 0])
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


def test_int4_g64_t0_keeps_an_attention_sink_exactly():
    """A block whose token 0 is unlike the rest (an attention sink: keys far larger): int4_g64_t0
    decodes it exactly and the other tokens' keys with a fraction of int4_g64's error, which
    quantises every key channel over a range the sink widens; values as int4_g64's per row."""
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = realistic_kv(L, T, H, D, seed=42)
    k = k.float()
    k[:, 0] = k[:, 0] * 10 + 30
    block = pack_block(k.to(torch.bfloat16), v, layout.layout)
    k = k.to(torch.bfloat16)
    errs = {}
    for codec in ("int4_g64", "int4_g64_t0"):
        k2, v2 = unpack_block(roundtrip(codec, block, layout), layout.layout, L, T, H, D)
        errs[codec] = [float((b[:, 1:].float() - a[:, 1:].float()).norm() / a[:, 1:].float().norm())
                       for a, b in ((k, k2), (v, v2))]
        if codec == "int4_g64_t0":
            assert torch.equal(k2[:, 0], k[:, 0]) and torch.equal(v2[:, 0], v[:, 0])
    assert errs["int4_g64_t0"][0] * 5 < errs["int4_g64"][0], errs
    assert errs["int4_g64_t0"][1] == errs["int4_g64"][1], errs
    ratio = layout.block_bytes / len(encode_block("int4_g64_t0", as_bytes(block), layout)[1])
    assert 3.0 < ratio < layout.block_bytes / len(encode_block("int4_g64", as_bytes(block), layout)[1])


def test_fp8_known_answer():
    """A row whose amax is 448 gets scale 1.0; e4m3-representable values decode exactly and
    encode to their e4m3 bit patterns."""
    L, T, H, D = 1, 1, 1, 8
    layout = make_layout(L=L, T=T, H=H, D=D)
    row = torch.tensor([448, -448, 1.5, 0.125, -256, 0, 3.5, 2 ** -9])
    block = pack_block(row.view(1, 1, 1, D), (row / 2).view(1, 1, 1, D), layout.layout).to(torch.bfloat16)
    cid, payload = encode_block("fp8", as_bytes(block), layout)
    codes = payload[HEADER_BYTES:HEADER_BYTES + 2 * D]
    assert codes[:D].tolist() == [0x7E, 0xFE, 0x3C, 0x20, 0xF8, 0x00, 0x46, 0x01]
    scales = torch.from_numpy(payload[HEADER_BYTES + 16:HEADER_BYTES + 20].copy()).view(torch.bfloat16)
    assert scales.tolist() == [1.0, 0.5]
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


def test_int4_known_answer():
    """Keys t % 16 along tokens and values i % 16 along dims are exact on the 16-level grid:
    decode is exact and the packed nibbles are predictable."""
    L, T, H, D = 1, 32, 1, 32
    layout = make_layout(L=L, T=T, H=H, D=D)
    k = (torch.arange(T) % 16).float().view(1, T, 1, 1).expand(L, T, H, D)
    v = (torch.arange(D) % 16).float().view(1, 1, 1, D).expand(L, T, H, D)
    block = pack_block(k, v, layout.layout).to(torch.bfloat16)
    cid, payload = encode_block("int4_g32", as_bytes(block), layout)
    n = L * T * H * D // 2
    k_codes = payload[HEADER_BYTES:HEADER_BYTES + n].reshape(T, D // 2)
    v_codes = payload[HEADER_BYTES + n:HEADER_BYTES + 2 * n].reshape(T, D // 2)
    assert [row[0] for row in k_codes.tolist()] == [(t % 16) * 0x11 for t in range(T)]
    assert v_codes[0].tolist() == [(2 * i % 16) | ((2 * i + 1) % 16) << 4 for i in range(D // 2)]
    assert torch.equal(decode_block(cid, payload, layout).view(torch.bfloat16), block)


@pytest.mark.parametrize("codec", LOSSY)
def test_constant_and_zero_blocks_are_exact(codec):
    """(A rotation turns a constant INT4 value row into one coefficient and 63 zeros, and an
    asymmetric grid from a negative minimum to 0 need not hold 0 exactly: only zeros are exact.)"""
    layout = make_layout()
    for value in (0.0, -3.25) if codec != "int4_g64_k16_had" else (0.0,):
        block = torch.full((layout.block_bytes // 2,), value, dtype=torch.bfloat16)
        assert torch.equal(roundtrip(codec, block, layout), block)


@pytest.mark.parametrize("codec", list(CODEC_IDS))
def test_encoding_is_deterministic(codec):
    layout = make_layout()
    block = as_bytes(pack_block(*realistic_kv(2, 32, 2, 64, seed=3), layout.layout))
    assert bytes(encode_block(codec, block, layout)[1]) == bytes(encode_block(codec, block, layout)[1])


def test_compression_ratios_for_bf16_blocks():
    layout = make_layout(L=4, T=32, H=8, D=128)
    block = as_bytes(pack_block(*realistic_kv(4, 32, 8, 128), layout.layout))
    ratio = {c: layout.block_bytes / len(encode_block(c, block, layout)[1]) for c in LOSSY}
    assert ratio["fp8"] >= 1.9 and ratio["fp8_head"] >= 1.9
    assert ratio["int4_g32"] >= 3.1 and ratio["int4_g128"] > ratio["int4_g32"]


# --- buffers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["fp8", "int4_g32", "zstd", "raw"])
def test_inputs_and_out_buffers_of_every_kind(codec):
    layout = make_layout()
    block = pack_block(*realistic_kv(2, 32, 2, 64, seed=4), layout.layout)
    want = roundtrip(codec, block, layout)
    raw = as_bytes(block)
    for source in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8), block):
        cid, payload = encode_block(codec, source, layout)
        for p in (payload, bytes(payload), torch.from_numpy(np.array(payload))):
            np_out = np.zeros(layout.block_bytes, np.uint8)
            got = decode_block(cid, p, layout, out=np_out)
            assert np.shares_memory(got.numpy(), np_out)
            assert torch.equal(got.view(torch.bfloat16), want)
            t_out = torch.zeros(layout.block_bytes // 2, dtype=torch.bfloat16)
            got = decode_block(cid, p, layout, out=t_out)
            assert got.data_ptr() == t_out.data_ptr() and torch.equal(t_out, want)


def test_bad_buffers_are_refused():
    layout = make_layout()
    raw = bytes(layout.block_bytes)
    cid, payload = encode_block("fp8", raw, layout)
    with pytest.raises(CodecError, match="read-only"):
        decode_block(cid, payload, layout, out=np.frombuffer(raw, np.uint8))
    with pytest.raises(CodecError, match="out"):
        decode_block(cid, payload, layout, out=np.zeros(layout.block_bytes - 1, np.uint8))
    with pytest.raises(CodecError, match="raw: is 7 bytes"):
        encode_block("fp8", b"1234567", layout)
    with pytest.raises(CodecError, match="expected bytes"):
        encode_block("fp8", [1, 2, 3], layout)


# --- refusals: layouts and dtypes a codec cannot interpret -------------------------------------

@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("kwargs, why", [
    (dict(layout="opaque"), "not a layout codecs understand"),
    (dict(layout="kv,layer,token,head"), "not a layout codecs understand"),
    (dict(layout="kv,kv,token,head,dim"), "not a layout codecs understand"),
    (dict(kv_per_token=1), "MLA"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype="float8_e4m3fn"), "dtype"),
    (dict(block_bytes=1 << 20), "padded"),
])
def test_lossy_codecs_refuse_layouts_they_cannot_interpret(codec, kwargs, why):
    layout = make_layout(**kwargs)
    with pytest.raises(CodecError, match=why):
        check_layout(codec, layout)
    with pytest.raises(CodecError, match=why):
        encode_block(codec, bytes(layout.block_bytes), layout)


def test_int4_refuses_groups_that_do_not_divide():
    with pytest.raises(CodecError, match="block_tokens=48"):
        check_layout("int4_g32", make_layout(T=48))
    with pytest.raises(CodecError, match="head_dim=80"):
        check_layout("int4_g64", make_layout(D=80))
    with pytest.raises(CodecError, match="head_dim=80"):
        check_layout("int4_g32", make_layout(D=80))
    check_layout("int4_g32", make_layout(T=16, D=64))   # keys: groups of all 16 tokens
    check_layout("int4_g128", make_layout(T=64, D=32))  # values: groups of all 32 dims


def test_zstd_accepts_any_layout_and_dtype():
    for layout in (make_layout(layout="opaque", dtype="int8"), make_layout(kv_per_token=1),
                   make_layout(dtype="float32")):
        raw = np.random.default_rng(5).integers(0, 4, layout.block_bytes, dtype=np.uint8)
        cid, payload = encode_block("zstd", raw, layout)
        assert bytes(decode_block(cid, payload, layout).numpy()) == raw.tobytes()


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["K", "V"])
def test_nan_and_inf_are_refused(codec, bad, where):
    L, T, H, D = 2, 32, 2, 64
    layout = make_layout(L=L, T=T, H=H, D=D)
    k, v = realistic_kv(L, T, H, D)
    (k if where == "K" else v)[1, 5, 1, 7] = bad
    with pytest.raises(CodecError, match=f"NaN or Inf in {where}" if "int4" in codec else "NaN or Inf"):
        encode_block(codec, as_bytes(pack_block(k, v, layout.layout)), layout)


# --- refusals: damaged payloads ---------------------------------------------------------------

@pytest.fixture(scope="module")
def encoded():
    layout = make_layout()
    block = as_bytes(pack_block(*realistic_kv(2, 32, 2, 64, seed=6), layout.layout))
    return layout, {c: encode_block(c, block, layout) for c in CODEC_IDS if c != "raw"}


@pytest.mark.parametrize("codec", [c for c in CODEC_IDS if c != "raw"])
def test_truncated_payloads_are_refused(encoded, codec):
    layout, payloads = encoded
    cid, payload = payloads[codec]
    for cut in (0, 10, HEADER_BYTES - 1, HEADER_BYTES, len(payload) - 1):
        with pytest.raises(CodecError, match="truncated"):
            decode_block(cid, payload[:cut], layout)
    with pytest.raises(CodecError, match="truncated or padded"):
        decode_block(cid, np.concatenate([payload, np.zeros(1, np.uint8)]), layout)


@pytest.mark.parametrize("codec", [c for c in CODEC_IDS if c != "raw"])
def test_every_corrupted_byte_is_detected(encoded, codec):
    layout, payloads = encoded
    cid, payload = payloads[codec]
    positions = list(range(HEADER_BYTES)) + list(range(HEADER_BYTES, len(payload), 997)) + [len(payload) - 1]
    for pos in positions:
        bad = payload.copy()
        bad[pos] ^= 0x40
        with pytest.raises(CodecError):
            decode_block(cid, bad, layout)


def test_payload_labelled_with_another_codec_is_refused(encoded):
    layout, payloads = encoded
    _, payload = payloads["fp8"]
    with pytest.raises(CodecError, match="labelled codec 3 .* header says codec 1"):
        decode_block(3, payload, layout)
    with pytest.raises(CodecError, match="raw block is"):
        decode_block(0, payload, layout)


def test_payload_decoded_with_another_layout_is_refused(encoded):
    layout, payloads = encoded
    cid, payload = payloads["int4_g32"]
    with pytest.raises(CodecError, match="encoded for"):
        decode_block(cid, payload, make_layout(L=4, T=16))
    with pytest.raises(CodecError, match="encoded for"):
        decode_block(cid, payload, make_layout(dtype="float16"))


@pytest.mark.parametrize("codec", [c for c in CODEC_IDS if c != "raw"])
def test_check_payload_refuses_what_decode_refuses_without_decoding(encoded, codec):
    """``check_payload`` is decode's checks alone (for a client-encoded payload before it is
    stored): a good payload passes; a flipped byte anywhere, a cut, another codec's label or
    another layout is a CodecError."""
    layout, payloads = encoded
    cid, payload = payloads[codec]
    check_payload(cid, payload, layout)
    check_payload(0, np.zeros(layout.block_bytes, np.uint8), layout)
    for pos in list(range(0, HEADER_BYTES, 7)) + [HEADER_BYTES, len(payload) // 2, len(payload) - 1]:
        bad = payload.copy()
        bad[pos] ^= 0x40
        with pytest.raises(CodecError):
            check_payload(cid, bad, layout)
    with pytest.raises(CodecError, match="truncated"):
        check_payload(cid, payload[:-1], layout)
    with pytest.raises(CodecError, match="header says codec"):
        check_payload(cid % 6 + 1, payload, layout)
    with pytest.raises(CodecError, match="encoded for"):
        check_payload(cid, payload, make_layout(L=4, T=16))
    with pytest.raises(CodecError, match="raw block is"):
        check_payload(0, payload, layout)


# --- property: any permutation layout, any small shape -----------------------------------------

@settings(max_examples=40, deadline=None)
@given(order=st.permutations(AXES), L=st.integers(1, 3), T=st.sampled_from([1, 4, 16, 32]),
       H=st.integers(1, 3), D=st.sampled_from([2, 8, 32, 64]), dtype=st.sampled_from(list(TORCH_DTYPES)),
       codec=st.sampled_from(list(CODEC_IDS)), seed=st.integers(0, 2 ** 16))
def test_property_any_permutation_layout(order, L, T, H, D, dtype, codec, seed):
    name = ",".join(order)
    layout = make_layout(name, L, T, H, D, dtype)
    k, v = realistic_kv(L, T, H, D, TORCH_DTYPES[dtype], seed)
    if codec == "int4_g64_t0" and T == 1:   # keeps token 0 exactly: nothing left to quantise
        with pytest.raises(Refused) as refused:
            roundtrip(codec, pack_block(k, v, name), layout)
        assert refused.value.reason == "group"
        return
    out = roundtrip(codec, pack_block(k, v, name), layout)
    k2, v2 = unpack_block(out, name, L, T, H, D)
    if not get_codec(codec).lossy:
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:
        # reference: the same K/V in the canonical layout must decode identically
        ref_layout = make_layout("kv,layer,token,head,dim", L, T, H, D, dtype)
        ref = roundtrip(codec, pack_block(k, v, ref_layout.layout), ref_layout)
        k3, v3 = unpack_block(ref, ref_layout.layout, L, T, H, D)
        assert torch.equal(k2, k3) and torch.equal(v2, v3)
        scale = max(k.float().abs().max().item(), v.float().abs().max().item())
        assert (k2.float() - k.float()).abs().max().item() <= scale * 0.5


# --- the compiled CPU kernels against the torch reference, bit for bit ------------------------

try:
    import numba  # noqa: F401
    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False
needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed: only the torch reference runs")


def encode_both(codec, raw, layout, monkeypatch):
    import kvstore.codecs.base as base
    monkeypatch.setattr(base, "USE_FAST", False)
    ref = encode_block(codec, raw, layout)[1]
    ref_out = decode_block(CODEC_IDS[codec], ref, layout)
    monkeypatch.setattr(base, "USE_FAST", True)
    warm_up()   # (until the kernels are compiled, the codecs run the reference: both sides would be it)
    assert compiled_on_cpu(codec, layout)
    fast = encode_block(codec, raw, layout)[1]
    fast_out = decode_block(CODEC_IDS[codec], fast, layout)
    return ref, fast, ref_out, fast_out


def special_values_block(layout: KVLayout, seed: int) -> bytes:
    """bf16 words that stress rounding: subnormals, huge values, both zeros, e4m3 ties."""
    g = torch.Generator().manual_seed(seed)
    n = layout.block_bytes // 2
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
    picks = torch.randint(0, 6, (n,), generator=g)
    x = torch.where(picks == 0, torch.tensor(0.0), x)
    x = torch.where(picks == 1, torch.tensor(-0.0), x)
    x = torch.where(picks == 2, torch.randn(n, generator=g) * 1e-39, x)   # bf16 subnormals
    x = torch.where(picks == 3, torch.randn(n, generator=g) * 1e37, x)    # near bf16 max
    return as_bytes(x.to(torch.bfloat16))


@needs_numba
@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_fast_kernels_match_reference_bit_for_bit(codec, layout_name, monkeypatch):
    layout = make_layout(layout_name, L=3, T=32, H=2, D=64)
    for raw in (as_bytes(pack_block(*realistic_kv(3, 32, 2, 64, seed=7), layout_name)),
                special_values_block(layout, seed=8),
                as_bytes(torch.zeros(layout.block_bytes // 2, dtype=torch.bfloat16))):
        ref, fast, ref_out, fast_out = encode_both(codec, raw, layout, monkeypatch)
        assert np.array_equal(ref, fast)
        assert torch.equal(ref_out, fast_out)


@needs_numba
@settings(max_examples=25, deadline=None)
@given(order=st.permutations(AXES), L=st.integers(1, 5), T=st.sampled_from([2, 16, 32, 64]),
       H=st.integers(1, 3), D=st.sampled_from([2, 32, 64, 128]), codec=st.sampled_from(LOSSY),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_property_fast_kernels_match_reference(order, L, T, H, D, codec, threads, seed):
    import kvstore.codecs.base as base
    layout = make_layout(",".join(order), L, T, H, D)
    raw = special_values_block(layout, seed) if seed % 2 else as_bytes(
        pack_block(*realistic_kv(L, T, H, D, seed=seed), layout.layout))
    saved = (base.USE_FAST, torch.get_num_threads())
    try:
        torch.set_num_threads(threads)
        base.USE_FAST = False
        ref = encode_block(codec, raw, layout)[1]
        ref_out = decode_block(CODEC_IDS[codec], ref, layout)
        base.USE_FAST = True
        warm_up()   # (the compiled kernels, not the reference twice)
        fast = encode_block(codec, raw, layout)[1]
        assert np.array_equal(ref, fast)
        assert torch.equal(decode_block(CODEC_IDS[codec], fast, layout), ref_out)
    finally:
        base.USE_FAST = saved[0]
        torch.set_num_threads(saved[1])


@pytest.mark.parametrize("codec", LOSSY)
def test_reference_path_refuses_nan_too(codec, monkeypatch):
    import kvstore.codecs.base as base
    monkeypatch.setattr(base, "USE_FAST", False)
    layout = make_layout()
    k, v = realistic_kv(2, 32, 2, 64)
    v[0, 0, 0, 0] = float("nan")
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode_block(codec, as_bytes(pack_block(k, v, layout.layout)), layout)


def test_concurrent_encodes_and_decodes_match_sequential():
    """The daemon encodes from several threads at once: results must not depend on that."""
    from concurrent.futures import ThreadPoolExecutor

    warm_up()
    layout = make_layout("kv,token,layer,head,dim", L=4, T=32, H=2, D=64)
    blocks = [as_bytes(pack_block(*realistic_kv(4, 32, 2, 64, seed=s), layout.layout)) for s in range(8)]
    jobs = [(c, b) for c in LOSSY for b in blocks]

    def work(job):
        cid, payload = encode_block(job[0], job[1], layout)
        return bytes(payload), bytes(decode_block(cid, payload, layout).numpy())

    sequential = [work(j) for j in jobs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(work, jobs)) == sequential


# --- device independence: the CPU twin of tests/test_codecs_cuda.py ---------------------------

class CudaScalarDivision:
    """A dispatch mode that computes ``tensor / scalar`` the way CUDA torch does
    (``div_true_kernel_cuda``: a CPU-scalar divisor becomes ``x * (1 / divisor)``, the reciprocal
    rounded in float32), and records every such division. Under it, the reference encoder runs
    CUDA's arithmetic on the CPU."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        aten = torch.ops.aten
        divs = {aten.div.Tensor: aten.mul.Tensor, aten.div.Scalar: aten.mul.Tensor,
                aten.div_.Tensor: aten.mul_.Tensor, aten.div_.Scalar: aten.mul_.Tensor}

        class Mode(TorchDispatchMode):
            scalar_divisions: list = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in divs and not kwargs.get("rounding_mode"):
                    x, b = args[0], args[1]
                    if not isinstance(b, torch.Tensor) or (b.dim() == 0 and b.device.type == "cpu"):
                        self.scalar_divisions.append((func, float(b)))
                        opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
                        inv = torch.tensor(1.0, dtype=opmath) / torch.tensor(float(b), dtype=opmath)
                        return divs[func](x, inv)
                return func(*args, **kwargs)

        mode = Mode()
        mode.scalar_divisions = []
        return mode


def reference_payload(codec, raw, layout, monkeypatch, mode=None):
    import contextlib

    import kvstore.codecs.base as base
    monkeypatch.setattr(base, "USE_FAST", False)
    with mode if mode is not None else contextlib.nullcontext():
        payload = encode_block(codec, raw, layout)[1]
    monkeypatch.undo()
    return payload


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("codec", LOSSY)
def test_payload_does_not_depend_on_device_arithmetic(codec, dtype, monkeypatch):
    """The inputs of tests/test_codecs_cuda.py::test_encode_on_gpu_gives_the_cpu_payload. The
    torch reference run with CUDA's division semantics, the plain CPU reference and (bf16) the
    compiled kernels must give the same bytes: no step may divide by a Python number, which CUDA
    turns into a multiplication by an inexact reciprocal (1/448, 1/15)."""
    layout = make_layout(L=3, T=32, H=2, D=64, dtype=dtype)
    raws = [as_bytes(pack_block(*realistic_kv(3, 32, 2, 64, TORCH_DTYPES[dtype], seed=12), layout.layout))]
    if dtype == "bfloat16":
        raws += [special_values_block(layout, seed=13), special_values_block(layout, seed=8)]
    for raw in raws:
        plain = reference_payload(codec, raw, layout, monkeypatch)
        mode = CudaScalarDivision()
        as_on_cuda = reference_payload(codec, raw, layout, monkeypatch, mode)
        assert np.array_equal(plain, as_on_cuda), f"{int((plain != as_on_cuda).sum())} bytes differ"
        assert mode.scalar_divisions == [], f"a codec divides by a Python scalar: inexact on CUDA: {mode.scalar_divisions}"
        if HAVE_NUMBA:  # (the compiled kernels cover bf16; other dtypes run the reference anyway)
            fast = encode_block(codec, raw, layout)[1]
            assert np.array_equal(plain, fast), f"{int((plain != fast).sum())} bytes differ"


def signed_zero_blocks(layout: KVLayout, seed: int) -> tuple[bytes, bytes]:
    """Two blocks equal as numbers, differing only in which of their zeros are -0.0: every
    group holds both zeros and otherwise positive values, so its minimum is a zero."""
    dtype = TORCH_DTYPES[layout.dtype]
    n = layout.block_bytes // torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 4 + 0.01
    i = torch.arange(n)
    zero_sign = torch.where((i // 3) % 2 == 0, torch.tensor(0.0), torch.tensor(-0.0))
    a = torch.where(i % 3 == 0, zero_sign, x)
    b = torch.where(i % 3 == 0, -zero_sign, x)
    return as_bytes(a.to(dtype)), as_bytes(b.to(dtype))


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("codec", [c for c in LOSSY if c.startswith("int4")])
def test_int4_statistics_do_not_depend_on_the_sign_of_zero(codec, dtype, monkeypatch):
    """A min/max reduction over +0 and -0 returns whichever it meets first, and CUDA visits
    elements in another order than the CPU: stored minima and scales must be +0 either way.
    (fp8 codes keep each element's sign, so only int4 statistics are concerned.)"""
    layout = make_layout(L=2, T=32, H=2, D=64, dtype=dtype)
    a, b = signed_zero_blocks(layout, seed=14)
    ref_a = reference_payload(codec, a, layout, monkeypatch)
    ref_b = reference_payload(codec, b, layout, monkeypatch)
    assert np.array_equal(ref_a, ref_b)
    if HAVE_NUMBA:
        assert np.array_equal(ref_a, encode_block(codec, a, layout)[1])
        assert np.array_equal(ref_b, encode_block(codec, b, layout)[1])
    out = decode_block(CODEC_IDS[codec], ref_a, layout).view(TORCH_DTYPES[dtype])
    assert not bool(torch.signbit(out[out == 0]).any())


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("codec", LOSSY)
def test_cuda_reduction_forms_give_the_cpu_payload(codec, dtype, monkeypatch):
    """On CUDA the reference takes each statistic in one kernel (inf-norm, ``aminmax``); on the CPU
    in their vectorised forms (``abs().amax()``, ``amin`` + ``amax``). Run here, on the CPU, both
    must give the same payload, decode to the same block and refuse NaN alike."""
    from kvstore.codecs import exact
    layout = make_layout("vllm_cpu" if dtype == "float16" else LAYOUTS[0], L=3, T=32, H=2, D=64, dtype=dtype)
    raws = [as_bytes(pack_block(*realistic_kv(3, 32, 2, 64, TORCH_DTYPES[dtype], seed=21), layout.layout)),
            *signed_zero_blocks(layout, seed=22)]
    if dtype == "bfloat16":
        raws.append(special_values_block(layout, seed=23))
    for raw in raws:
        plain = reference_payload(codec, raw, layout, monkeypatch)
        monkeypatch.setattr(exact, "one_kernel_reductions", lambda device: True)
        as_on_cuda = reference_payload(codec, raw, layout, monkeypatch)  # (undoes the patch after)
        assert np.array_equal(plain, as_on_cuda), f"{int((plain != as_on_cuda).sum())} bytes differ"
    k, v = realistic_kv(3, 32, 2, 64, TORCH_DTYPES[dtype])
    v[2, 31, 1, 63] = float("nan")
    monkeypatch.setattr(exact, "one_kernel_reductions", lambda device: True)
    with pytest.raises(CodecError, match="NaN or Inf in V"):
        reference_payload(codec, as_bytes(pack_block(k, v, layout.layout)), layout, monkeypatch)

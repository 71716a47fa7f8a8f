"""KV block codecs: raw, FP8 e4m3, INT8 (per-row or per-channel key scales), INT4 (KIVI-style; also with
each block's first token kept exactly), their Hadamard-rotated forms, zstd — the API the store and
client call.

Owns how a block's bytes become a smaller payload and back, for every layout it understands. It
imports only the leaves ``kvstore.keys``, ``kvstore.errors`` and ``kvstore.buffers`` from the rest
of kvstore (never the store, service, client, tiers or connectors), so both ends of the wire can
use it.

    codec_id, payload = encode_block("fp8", raw, layout)   # payload: 1-D numpy uint8 (host)
    block = decode_block(codec_id, payload, layout, out=gpu_buffer)  # torch uint8, out's device

* Codec ids are stable small ints stored with each block (``CODEC_IDS``); 0 = raw (payload is the
  block itself, no header). Never renumber one: stored blocks name their codec by id.
* ``encode_block`` runs on the device ``raw`` lives on (a CUDA tensor encodes on its GPU) and
  always returns the payload on the host, ready to store or send.
* ``decode_block`` decodes on the device of ``out`` (a preallocated uint8 buffer of the block's
  size: numpy, CPU or CUDA tensor); without ``out`` it returns a new CPU tensor. Only the
  compressed bytes cross to the device.
* Anything a codec cannot represent faithfully raises ``CodecError`` (a ``KVStoreError``):
  unknown codec id, a layout or dtype the codec does not interpret (store raw instead),
  NaN/Inf in a block, a truncated or corrupted payload, a payload encoded for another shape.
  Refusals to encode (layout, dtype, NaN/Inf) are ``Refused`` with a stable ``reason``
  (``REASONS``): the label under which the store counts blocks and bytes it kept raw.
* Layouts: K+V blocks, K-only / V-only segments and MLA latents, in the axis grammar of
  ``codecs.layout`` or an engine name from ``codecs.engine_layouts``.

See docs/codecs.md for formats, fidelity and speed.
"""

from __future__ import annotations

import numpy as np

from kvstore.buffers import as_byte_array, as_byte_tensor
from kvstore.codecs.codec import Codec
from kvstore.codecs.header import HEADER_BYTES, parse_header, verify_body
from kvstore.codecs.lossless import RawCodec, ZstdCodec
from kvstore.codecs.refusal import REASONS, Refused, reason_of
from kvstore.errors import CodecError
from kvstore.keys import KVLayout

try:
    import torch
except ImportError:   # the core install: raw and zstd work, the lossy codecs say what to install
    torch = None

__all__ = ["CODEC_IDS", "Codec", "CodecError", "INSTALL_HINT", "REASONS", "Refused", "check_layout", "check_payload",
           "codec_for_id", "compiled_on_cpu", "decode_block", "encode_block", "get_codec", "reason_of",
           "unavailable", "warm_up"]

#: what makes the lossy codecs run where they do not (torch computes them; numba compiles their CPU kernels)
INSTALL_HINT = "pip install 'kvstore[codecs]'"

#: the lossy codecs: (name, id, kind, parameter). Ids are stored with blocks: never renumber one.
#: Id 13 is taken (``int4_g64_out1``: each layer's most range-widening token kept exactly; measured
#: and not kept, benchmarks/results/fidelity_real_floor.md): never give it to another codec.
_LOSSY = (("fp8", 1, "fp8", False), ("fp8_head", 2, "fp8", True),
          ("int4_g32", 3, "int4", 32), ("int4_g64", 4, "int4", 64), ("int4_g128", 5, "int4", 128),
          ("int4_g64_k16", 7, "int4", (64, 16)), ("int8", 8, "int8", False),
          ("int8_had", 9, "int8", True), ("int4_g64_k16_had", 10, "int4", (64, 16, True)),
          ("int8_kchan", 11, "int8_kchan", None), ("int4_g64_t0", 12, "int4_t0", 64))


class NeedsTorch(Codec):
    """A lossy codec in an install without torch: every use raises ``CodecError`` naming the
    extra to install, so a daemon or planner can refuse at start in one line (``unavailable``)."""

    lossy = True

    def __init__(self, name: str, codec_id: int) -> None:
        self.name, self.codec_id = name, codec_id

    @property
    def reason(self) -> str:
        return f"{self.name} needs torch, which this install lacks: {INSTALL_HINT}"

    def check_layout(self, layout: KVLayout) -> None:
        raise CodecError(self.reason)

    def header_param(self, layout: KVLayout) -> int:
        raise CodecError(self.reason)

    def encode(self, raw, layout: KVLayout) -> np.ndarray:
        raise CodecError(self.reason)

    def decode(self, header, body, layout: KVLayout, out) -> None:
        raise CodecError(self.reason)


def _lossy_codecs() -> tuple[Codec, ...]:
    if torch is None:
        return tuple(NeedsTorch(name, codec_id) for name, codec_id, _, _ in _LOSSY)
    from kvstore.codecs.fp8 import Fp8Codec
    from kvstore.codecs.int4 import Int4Codec
    from kvstore.codecs.int4_t0 import Int4FirstTokenCodec
    from kvstore.codecs.int8 import Int8Codec
    from kvstore.codecs.int8_kchan import Int8KchanCodec

    def make(name: str, codec_id: int, kind: str, param) -> Codec:
        if kind == "fp8":
            return Fp8Codec(name, codec_id, per_head=param)
        if kind == "int8":
            return Int8Codec(name, codec_id, rotated=param)
        if kind == "int8_kchan":
            return Int8KchanCodec(name, codec_id)
        if kind == "int4_t0":
            return Int4FirstTokenCodec(name, codec_id, group=param)
        group, key_group, rotated = (param + (False,))[:3] if isinstance(param, tuple) else (param, None, False)
        return Int4Codec(name, codec_id, group=group, key_group=key_group, rotated=rotated)
    return tuple(make(*spec) for spec in _LOSSY)


_CODECS: tuple[Codec, ...] = (RawCodec(), *_lossy_codecs(), ZstdCodec("zstd", 6))
_BY_ID = {c.codec_id: c for c in _CODECS}
_BY_NAME = {c.name: c for c in _CODECS}

#: codec name -> stable id stored with each block
CODEC_IDS: dict[str, int] = {c.name: c.codec_id for c in _CODECS}


def codec_for_id(codec_id: int) -> Codec:
    try:
        return _BY_ID[int(codec_id)]
    except (KeyError, TypeError, ValueError):
        raise CodecError(f"unknown codec id {codec_id!r}: this build knows {CODEC_IDS}") from None


def get_codec(name_or_id: str | int) -> Codec:
    if isinstance(name_or_id, str):
        try:
            return _BY_NAME[name_or_id]
        except KeyError:
            raise CodecError(f"unknown codec {name_or_id!r}: one of {sorted(CODEC_IDS)}") from None
    return codec_for_id(name_or_id)


def check_layout(name_or_id: str | int, layout: KVLayout) -> None:
    """Raise ``Refused`` (a ``CodecError`` saying why, ``.reason`` a stable label) if this codec
    cannot encode blocks of ``layout``.

    Call it once per namespace and tier to decide raw vs encoded, instead of per block.
    """
    get_codec(name_or_id).check_layout(layout)


def unavailable(name_or_id: str | int) -> str | None:
    """Why this codec cannot run in this install (one line naming what to install), or None."""
    codec = get_codec(name_or_id)
    return codec.reason if isinstance(codec, NeedsTorch) else None


def compiled_on_cpu(name_or_id: str | int, layout: KVLayout) -> bool:
    """Whether encoding and decoding blocks of ``layout`` on the CPU runs the compiled kernels now
    (bf16, numba installed, a layout whose rows they can address, the kernels compiled: ``warm_up``
    waits for that), not the eager torch reference."""
    codec = get_codec(name_or_id)
    if not codec.lossy or isinstance(codec, NeedsTorch):
        return False
    return codec.fast_modules(codec.shape_of(layout), torch.device("cpu")) is not None


def _numel(t) -> int:
    return t.size if isinstance(t, np.ndarray) else t.numel()


def _block_bytes(raw, layout: KVLayout, field: str):
    """A flat uint8 view of ``raw``: a torch tensor when torch is installed, else a numpy array."""
    t = as_byte_tensor(raw, field) if torch is not None else as_byte_array(raw, field)
    if _numel(t) != layout.block_bytes:
        raise CodecError(f"{field}: is {_numel(t)} bytes; blocks of this layout are "
                         f"{layout.block_bytes} bytes")
    return t


def _host(t) -> np.ndarray:
    """Host numpy bytes of a view from ``_block_bytes`` (a device tensor is copied back)."""
    if isinstance(t, np.ndarray):
        return t
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


def encode_block(name_or_id: str | int, raw, layout: KVLayout) -> tuple[int, np.ndarray]:
    """Encode one block. ``raw``: bytes-like, numpy array or torch tensor (CPU or CUDA) of
    exactly ``layout.block_bytes`` bytes in the layout's byte order.

    Returns ``(codec_id, payload)``; payload is a 1-D numpy uint8 array on the host (for raw,
    a zero-copy view of ``raw`` when it is already host memory).
    """
    codec = get_codec(name_or_id)
    t = _block_bytes(raw, layout, "raw")
    if codec.codec_id == 0:
        return 0, _host(t)
    return codec.codec_id, codec.encode(t if codec.lossy else _host(t), layout)


def _writable_out(out, layout: KVLayout):
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise CodecError("out: array is read-only")
    if isinstance(out, (bytes, memoryview)):
        raise CodecError("out: must be a writable numpy array, bytearray or torch tensor")
    return _block_bytes(out, layout, "out")


def decode_block(codec_id: int, payload, layout: KVLayout, out=None):
    """Decode one block into ``out`` (or a new CPU buffer) and return it as a flat torch uint8
    tensor of ``layout.block_bytes`` (sharing memory with ``out`` when given); without torch (the
    core install: raw and zstd only) as a flat numpy uint8 array.

    ``payload``: bytes-like, numpy array or torch tensor. Its header is read and checksummed on
    the host (a CUDA payload is copied back for that); decoding runs on ``out``'s device.
    """
    codec = codec_for_id(codec_id)
    if out is not None:
        dst = _writable_out(out, layout)
    else:
        dst = (torch.empty(layout.block_bytes, dtype=torch.uint8) if torch is not None
               else np.empty(layout.block_bytes, dtype=np.uint8))
    src = as_byte_tensor(payload, "payload") if torch is not None else as_byte_array(payload, "payload")
    if codec.codec_id == 0:
        if _numel(src) != layout.block_bytes:
            raise CodecError(f"payload: raw block is {_numel(src)} bytes; blocks of this layout "
                             f"are {layout.block_bytes} bytes")
        if isinstance(dst, np.ndarray):
            dst[...] = _host(src)
        else:
            dst.copy_(src)
        return dst
    host = _host(src)
    header = _checked_header(codec, host, layout)
    codec.decode(header, host[HEADER_BYTES:], layout, dst)
    return dst


def check_payload(codec_id: int, payload, layout: KVLayout) -> None:
    """Raise ``CodecError`` unless ``payload`` is a whole, intact block of ``layout`` encoded with
    ``codec_id``: what ``decode_block`` checks before it writes a byte (the header's magic, CRC32
    and fields, the body's length and xxh3-64, the codec's parameter, the block's shape and dtype,
    a decoded size the body declares),
    without decoding. A raw (0) payload must be exactly a block. For a payload from elsewhere (a
    client's own encoding) before it is stored as it is."""
    codec = codec_for_id(codec_id)
    src = as_byte_tensor(payload, "payload") if torch is not None else as_byte_array(payload, "payload")
    if codec.codec_id == 0:
        if _numel(src) != layout.block_bytes:
            raise CodecError(f"payload: raw block is {_numel(src)} bytes; blocks of this layout "
                             f"are {layout.block_bytes} bytes")
        return
    _checked_header(codec, _host(src), layout)


def _checked_header(codec: Codec, host: np.ndarray, layout: KVLayout):
    view = memoryview(host)
    header = parse_header(view)
    if header.codec_id != codec.codec_id:
        raise CodecError(f"block is labelled codec {codec.codec_id} ({codec.name}) but its payload "
                         f"header says codec {header.codec_id}")
    if header.param != codec.header_param(layout):
        raise CodecError(f"{codec.name}: payload parameter is {header.param}, expected "
                         f"{codec.header_param(layout)} for this layout")
    header.check_layout(layout)
    verify_body(header, view[HEADER_BYTES:])
    codec.check_body(host[HEADER_BYTES:], layout)
    return header


def warm_up() -> bool:
    """Compile (or load from the on-disk cache) the CPU kernels, wait for that, and run every lossy
    codec once. Until the kernels are compiled, codecs run the torch reference (the same bytes,
    slower: ``codecs.compiled``); a daemon calls this in a background thread at start, so the
    calls it answers soon after run at full speed. False without torch (nothing to compile)."""
    if torch is None:
        return False
    try:
        from kvstore.codecs import compiled, fast_cpu  # noqa: F401 - numba: its kernels to compile
    except ImportError:  # numba not installed: the torch reference runs, nothing to compile
        pass
    else:
        compiled.compile_all(wait=True)
    layout = KVLayout("kvstore/warm-up", num_layers=2, num_kv_heads=1, head_dim=32, dtype="bfloat16",
                      block_tokens=32, layout="kv,layer,token,head,dim")
    raw = torch.linspace(-1, 1, layout.block_bytes // 2).to(torch.bfloat16)
    for codec in _CODECS:
        if codec.lossy:
            decode_block(*encode_block(codec.codec_id, raw, layout), layout)
    return True

"""Request fields checked before they reach the Store, and request bytes parsed without raising.

Every handler turns wire fields into Store arguments through here, so one limit (``kvstore.wire``)
means the same thing on every RPC and a bad field is answered INVALID_ARGUMENT naming it. Request
bytes that are not a valid protobuf message become a ``Malformed`` marker instead of an exception
(gRPC would answer its own INTERNAL), and the call bridge answers INVALID_ARGUMENT for it.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.keys import MAX_HASH_BYTES, KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import MAX_BATCH, MAX_STRING


class Malformed:
    """What arrives in place of a request whose bytes are not a valid protobuf message."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def error(self) -> InvalidArgument:
        return InvalidArgument("request", f"not a valid {self.type_name} message (malformed protobuf)")


def lenient(message_cls, read=None):
    """Request deserializer that never raises: bad bytes become a ``Malformed`` marker. ``read``
    parses instead of ``message_cls.FromString`` (``chunks.read_put_chunk``: no copy of the data)."""
    read = read or message_cls.FromString

    def parse(data: bytes):
        try:
            return read(data)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            return Malformed(message_cls.DESCRIPTOR.full_name)
    return parse


def well_formed(message):
    """``message`` itself, or the INVALID_ARGUMENT a ``Malformed`` marker stands for."""
    if isinstance(message, Malformed):
        raise message.error()
    return message


def check_hashes(hashes, field: str = "hashes", allow_empty: bool = False) -> list[bytes]:
    if len(hashes) > MAX_BATCH:
        raise InvalidArgument(field, f"{len(hashes)} hashes in one call; at most {MAX_BATCH}")
    if not hashes and not allow_empty:
        raise InvalidArgument(field, "at least one block hash is required")
    out = list(hashes)   # (a request's repeated bytes field: bytes already; anything else converted)
    if set(map(type, out)) - {bytes}:
        out = [h if type(h) is bytes else bytes(h) for h in out]
    widths = set(map(len, out))   # one pass in C over a batch's hashes; the culprit named below
    if widths and not (min(widths) >= 1 and max(widths) <= MAX_HASH_BYTES):
        i, h = next((i, h) for i, h in enumerate(out) if not 1 <= len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"{field}[{i}]", f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(h)}")
    return out


def check_range(offset: int, nbytes: int, block_bytes: int) -> tuple[int, int] | None:
    """A get's byte range within each block (``range_offset``, ``range_bytes``), or None for the
    whole block."""
    if not nbytes:
        if offset:
            raise InvalidArgument("range_bytes", "a range_offset needs a range_bytes (0 = the whole block)")
        return None
    if offset + nbytes > block_bytes:
        raise InvalidArgument("range_bytes", f"bytes [{offset}, {offset + nbytes}) run past the end of a "
                                             f"{block_bytes}-byte block")
    return int(offset), int(nbytes)


def check_parent(parent: bytes) -> bytes | None:
    if not parent:
        return None
    if len(parent) > MAX_HASH_BYTES:
        raise InvalidArgument("parent", f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(parent)}")
    return bytes(parent)


def check_string(value: str, field: str) -> str:
    if len(value) > MAX_STRING:
        raise InvalidArgument(field, f"longer than {MAX_STRING} characters")
    return value


def layout_from_proto(m: pb.Layout) -> KVLayout:
    """Proto3 zeros mean "unset": a field a client leaves out gets KVLayout's default."""
    for name in ("model", "dtype", "layout"):
        check_string(getattr(m, name), f"layout.{name}")
    return KVLayout(model=m.model, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim, dtype=m.dtype, block_tokens=m.block_tokens,
                    layout=m.layout or "opaque", kv_per_token=m.kv_per_token or 2,
                    tp_rank=m.tp_rank, tp_size=m.tp_size or 1, pp_rank=m.pp_rank, pp_size=m.pp_size or 1,
                    cp_rank=m.cp_rank, cp_size=m.cp_size or 1, block_bytes=m.block_bytes)


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    return pb.Layout(**layout.to_dict())

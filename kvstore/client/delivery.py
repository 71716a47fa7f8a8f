"""Rules every data path (shm, side channel, gRPC chunks) applies to the blocks it moves.

Blocks cross the wire raw: the daemon decodes tier-encoded blocks before it sends them, so a block
that arrives with another codec id is refused by name rather than handed over as wrong bytes.
"""

from __future__ import annotations

import numpy as np

from kvstore.errors import CodecError, InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import RAW_CODEC

_PUT_RESULT = {pb.PUT_STORED: "stored", pb.PUT_EXISTS: "exists", pb.PUT_PERSISTED: "persisted"}


def put_results(resp) -> list[str]:
    """Per block "stored", "exists" or "persisted", from any put answer."""
    return [_PUT_RESULT[r] for r in resp.results]


def require_raw(codec: int, index: int) -> None:
    """Refuse a block that arrived encoded (no daemon of this version sends one)."""
    if codec != RAW_CODEC:
        raise CodecError(f"codec: block {index} arrived encoded with codec {codec}; this client takes "
                         f"raw blocks only (the daemon decodes before sending)")


def require_fit(size: int, dst: np.ndarray) -> None:
    if size > dst.nbytes:
        raise InvalidArgument("outs", f"block of {size} bytes does not fit a {dst.nbytes}-byte buffer")

"""Every error kvstore raises on purpose, each naming its cause.

The server maps these to gRPC status codes (``GRPC_STATUS`` below) so a client sees the same
class again; connectors catch ``KVStoreError`` and recompute.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every deliberate kvstore error; ``field``, when given, names the request field at
    fault (the client gets it back with the class)."""

    grpc_status = "INTERNAL"

    def __init__(self, *args, field: str | None = None) -> None:
        super().__init__(*args)
        if field:
            self.field = field


class InvalidArgument(KVStoreError, ValueError):
    """A request field is malformed; ``field`` names it."""

    grpc_status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class UnknownNamespace(KVStoreError, KeyError):
    grpc_status = "NOT_FOUND"

    def __init__(self, namespace_id: bytes) -> None:
        self.namespace_id = namespace_id
        super().__init__(f"namespace_id: unknown namespace {namespace_id.hex()}; register it first")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


class LayoutMismatch(KVStoreError):
    """A client's layout differs from what the namespace (or a block) was stored with."""

    grpc_status = "FAILED_PRECONDITION"


class WrongBlockSize(InvalidArgument):
    def __init__(self, expected: int, got: int, index: int) -> None:
        super().__init__(f"blocks[{index}]", f"is {got} bytes; this namespace's blocks are {expected} bytes")


class BlockTooLarge(KVStoreError):
    grpc_status = "INVALID_ARGUMENT"


class TierFull(KVStoreError):
    """A tier cannot make room (everything evictable is pinned, or the medium is full)."""

    grpc_status = "RESOURCE_EXHAUSTED"


class StoreFull(TierFull):
    """No tier could take the block: the daemon is out of space."""


class TierIOError(KVStoreError):
    """The medium failed (unwritable directory, disk full, I/O error)."""

    grpc_status = "UNAVAILABLE"


class BlockCorrupt(KVStoreError):
    """Stored bytes failed their checksum; the tier has already dropped the block."""

    grpc_status = "DATA_LOSS"


class HashSelfCheckFailed(KVStoreError):
    """Hashing is not deterministic here: refusing to run rather than never hitting."""


class LeaseExpired(KVStoreError):
    grpc_status = "FAILED_PRECONDITION"


class BlockBusy(KVStoreError):
    """A put of a block that was deleted while a reader still holds it: the old copy is not freed
    yet (waited for a bounded time, or too many puts already wait). Retry shortly."""

    grpc_status = "ABORTED"

    def __init__(self, key: bytes | None = None) -> None:
        super().__init__("hashes: a block being put was deleted while a reader still holds it; "
                         "retry once the reader is done")
        self.field = "hashes"


class PermissionDenied(KVStoreError):
    grpc_status = "PERMISSION_DENIED"


class Unauthenticated(KVStoreError):
    grpc_status = "UNAUTHENTICATED"


class QuotaExceeded(KVStoreError):
    grpc_status = "RESOURCE_EXHAUSTED"


class DaemonUnavailable(KVStoreError):
    """The daemon cannot be reached (down, slow past the deadline): connectors recompute."""

    grpc_status = "UNAVAILABLE"


class CodecError(KVStoreError):
    """A codec cannot encode or decode this block (NaN/Inf, unsupported dtype, unknown codec id)."""

    grpc_status = "INVALID_ARGUMENT"


class FleetModeOff(KVStoreError):
    """A fleet RPC (Route) on a daemon that runs without a fleet directory."""

    grpc_status = "FAILED_PRECONDITION"

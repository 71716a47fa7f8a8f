"""How a failed RPC becomes a kvstore exception on the client side.

The daemon attaches the kvstore error class (and the field it names) to the trailing metadata of
every deliberate failure, so the client raises the same class the daemon raised; an unreachable
daemon (refused, reset, past the deadline) becomes ``DaemonUnavailable``, which connectors treat
as a miss; anything else keeps its gRPC status as ``RemoteError``.
"""

from __future__ import annotations

import grpc

from kvstore import errors
from kvstore.errors import DaemonUnavailable, KVStoreError

UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                               grpc.StatusCode.CANCELLED})


class RemoteError(KVStoreError):
    """An error status the daemon did not attach a kvstore class to (e.g. gRPC's own limits)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.grpc_status = code.name
        super().__init__(f"{code.name}: {message}")


class DaemonRestarted(DaemonUnavailable):
    """A lease came from another daemon run than the arena we mapped (the Client renegotiates)."""


def error_from_rpc(e: grpc.RpcError) -> KVStoreError:
    """The kvstore exception a failed RPC stands for."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    meta = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    err = _named(meta.get("kvstore-error"), details, meta.get("kvstore-field"))
    if err is not None:
        return err
    if code in UNREACHABLE_CODES:
        return DaemonUnavailable(f"kvstore daemon unreachable ({code.name}): {details}")
    return RemoteError(code, details)


def error_named(name: str, details: str, field: str = "") -> KVStoreError:
    """The kvstore exception the daemon raised as class ``name`` (over its Unix socket); an
    unknown or empty name is the daemon's internal error."""
    return _named(name, details, field) or RemoteError(grpc.StatusCode.INTERNAL, details)


def _named(name: str | None, details: str, field: str | None) -> KVStoreError | None:
    cls = getattr(errors, name, None) if name else None
    if not (isinstance(cls, type) and issubclass(cls, KVStoreError)):
        return None
    err = cls.__new__(cls)
    Exception.__init__(err, details)
    if field:
        err.field = field
    return err


def is_session_error(err: KVStoreError) -> bool:
    """True when the side-channel socket can no longer be trusted (daemon gone or session unknown)."""
    return isinstance(err, DaemonUnavailable) or getattr(err, "field", None) == "session"

"""The daemon's gRPC server, by its old name: ``build_server`` and the ``KVStoreServicer``.

The server was one module; it is now split by concept (``grpc_server``: the aio server, its
options, health and reflection; ``calls``: the call bridge; ``interceptors``: authentication;
``servicer`` with ``stream_rpcs``, ``lease_rpcs`` and ``bulk_rpcs``: the RPCs; ``validation``:
request checks). This module keeps the names callers already import.
"""

from __future__ import annotations

from kvstore.service.grpc_server import GrpcServer, add_kvstore_servicer, build_server
from kvstore.service.servicer import SERVICE_NAME, KVStoreServicer
from kvstore.service.validation import check_hashes, check_parent, layout_from_proto, layout_to_proto

__all__ = ["SERVICE_NAME", "GrpcServer", "KVStoreServicer", "add_kvstore_servicer", "build_server", "check_hashes",
           "check_parent", "layout_from_proto", "layout_to_proto"]

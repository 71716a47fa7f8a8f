"""A forging peer for the trust tests and reliability scenarios: a real gRPC server that speaks the
KVStore protocol like a daemon (Handshake, RegisterNamespace, Get) but serves bytes of its
choosing, and records every call it gets so that the call can be replayed byte for byte to an
honest daemon (``replay``).

It stands where an attacker would: at an address taken from a forged or replayed fleet directory
entry. What it records (each call's method, metadata and request bytes) is what a daemon gave
away to it: a peer token, a fleet secret or a peer proof would show there.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import PROTOCOL_VERSION


class ForgingPeer(pb_grpc.KVStoreServicer):
    """Serves ``blocks`` (hash -> bytes) for one namespace (``namespace_id``, ``block_bytes``,
    tenant ``tenant``) at ``address``: a port to take (a departed daemon's socket may linger, so
    binding is retried for 10 s), else any free one (``self.address`` says which). ``calls``: every
    call as (method, metadata, request bytes)."""

    def __init__(self, blocks: dict[bytes, bytes], namespace_id: bytes, block_bytes: int,
                 address: str = "127.0.0.1:0", tenant: str = "t") -> None:
        self.blocks, self.namespace_id, self.block_bytes, self.tenant = blocks, namespace_id, block_bytes, tenant
        self.calls: list[tuple[str, tuple, bytes]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KVStoreServicer_to_server(self, self.server)
        deadline = time.monotonic() + 10
        while not (port := self.server.add_insecure_port(address)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not bind {address}")
            time.sleep(0.1)
        self.address = f"{address.rpartition(':')[0]}:{port}"
        self.server.start()

    def _keep(self, method: str, request, context) -> None:
        self.calls.append((method, tuple(context.invocation_metadata()), request.SerializeToString()))

    def Handshake(self, request, context):
        self._keep("Handshake", request, context)
        return pb.HandshakeResponse(server_version=PROTOCOL_VERSION, server_id="forger", lease_seconds=5.0,
                                    max_message_bytes=16 << 20, chunk_bytes=1 << 20)

    def RegisterNamespace(self, request, context):
        self._keep("RegisterNamespace", request, context)
        return pb.RegisterNamespaceResponse(namespace_id=self.namespace_id, block_bytes=self.block_bytes,
                                            tenant=self.tenant)

    def Get(self, request, context):
        self._keep("Get", request, context)
        for i, h in enumerate(request.hashes):
            data = self.blocks.get(bytes(h))
            if data is None:
                yield pb.GetChunk(index=i, hit=False)
            else:
                yield pb.GetChunk(index=i, hit=True, size=len(data), offset=0, data=data)

    def tokens_seen(self) -> list[str]:
        """Each call's ``authorization`` header ("" where it sent none)."""
        return [dict(meta).get("authorization", "") for _, meta, _ in self.calls]

    def metadata_text(self) -> str:
        """Every metadata pair of every call, as one string to search for secrets."""
        return " ".join(f"{k}={v}" for _, meta, _ in self.calls for k, v in meta)

    def stop(self) -> None:
        self.server.stop(0)


def replay(channel: grpc.Channel, method: str, metadata: tuple, request: bytes):
    """A recorded call sent byte for byte over ``channel``: the answer (a Get's chunks as a list),
    or the ``grpc.StatusCode`` it was refused with."""
    call = channel.unary_stream if method == "Get" else channel.unary_unary
    fn = call(f"/kvstore.v1.KVStore/{method}", request_serializer=None, response_deserializer=None)
    try:
        out = fn(request, metadata=metadata, timeout=10)
        return list(out) if method == "Get" else out
    except grpc.RpcError as e:
        return e.code()

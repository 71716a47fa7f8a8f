"""Shared pieces of the fleet tests (tests/test_fleet.py, tests/test_fleet_trust.py,
tests/test_trust_peer_replay.py): one layout and namespace, the fleet secret every test node shares,
deterministic block chains, an in-process peer, a rogue gRPC peer, a polling wait and the config
file of a fleet daemon."""

from __future__ import annotations

import textwrap
import time
from concurrent import futures

import grpc
import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.store import Store
from kvstore.wire import PROTOCOL_VERSION

BLOCK_TOKENS = 16
LAYOUT = KVLayout(model="test/fleet", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                  block_tokens=BLOCK_TOKENS)   # 4 KiB blocks
NS = Namespace(LAYOUT, tenant="t", cache_salt="fleet")
BLOCK = LAYOUT.block_bytes
SECRET = "test-fleet-secret-0123456789abcdef"   # fleet.secret: every node of a test fleet shares it


class StorePeer:
    """The slice of ``kvstore.client.Client`` that peer fetch uses, answered by a peer's Store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.corrupt_next = False

    def get(self, namespace_id, hashes):
        out = self.store.get(namespace_id, hashes)
        if self.corrupt_next:
            out = [None if b is None else bytes([b[0] ^ 0xFF]) + b[1:] for b in out]
        return out

    def close(self) -> None:
        pass


class RoguePeer(pb_grpc.KVStoreServicer):
    """A real gRPC server speaking the KVStore protocol: answers Handshake / RegisterNamespace / Get
    like a daemon, serving bytes of its choosing, and keeps every call's method, metadata (where a
    peer token or proof would show) and request bytes (to replay them). ``address``: a port to take
    (a departed daemon's socket may linger, so binding is retried), else any free one."""

    def __init__(self, blocks: dict[bytes, bytes], address: str = "127.0.0.1:0") -> None:
        self.blocks = blocks
        self.calls: list[tuple[str, tuple, bytes]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KVStoreServicer_to_server(self, self.server)
        deadline = time.monotonic() + 10
        while not (port := self.server.add_insecure_port(address)):
            assert time.monotonic() < deadline, f"could not bind {address}"
            time.sleep(0.1)
        self.address = f"{address.rpartition(':')[0]}:{port}"
        self.server.start()

    def _keep(self, method: str, request, context) -> None:
        self.calls.append((method, tuple(context.invocation_metadata()), request.SerializeToString()))

    def Handshake(self, request, context):
        self._keep("Handshake", request, context)
        return pb.HandshakeResponse(server_version=PROTOCOL_VERSION, server_id="rogue", lease_seconds=5.0,
                                    max_message_bytes=16 << 20, chunk_bytes=1 << 20)

    def RegisterNamespace(self, request, context):
        self._keep("RegisterNamespace", request, context)
        return pb.RegisterNamespaceResponse(namespace_id=NS.id, block_bytes=BLOCK, tenant="t")

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


def chain(n: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    tokens = (np.arange(n * BLOCK_TOKENS) * 7919 + seed * 104729) % 50_000
    hashes = ChainHasher(seed=0).chain(tokens, BLOCK_TOKENS)
    blocks = [np.random.default_rng([seed, i]).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)]
    return hashes, blocks


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def write_fleet_config(workdir, redis_url: str, prefix: str, node_id: str, *, secret_in_file: bool = True,
                       fleet_extra: str = "", ttl_s: float = 1.5, extra: str = "") -> str:
    """A `kvstore serve --config` file for one fleet node: small tiers, fast heartbeats;
    ``fleet_extra`` holds more ``fleet.*`` lines (``key: value``, one per line), ``extra`` more
    top-level ones (``tokens:`` and the like)."""
    path = workdir / "kvstore.yaml"
    fleet_lines = (f"secret: {SECRET}\n" if secret_in_file else "") + textwrap.dedent(fleet_extra)
    path.write_text(textwrap.dedent(f"""
        cpu_bytes: 16MiB
        cpu_slot_bytes: 4KiB
        nvme_bytes: 0
        shm_dir: {workdir}
        lease_seconds: 1.0
        bulk_channel: false
        fleet:
          enabled: true
          redis_url: {redis_url}
          node_id: {node_id}
          key_prefix: {prefix}
          heartbeat_s: 0.2
          ttl_s: {ttl_s}
          peer_timeout_s: 2.0
    """) + textwrap.indent(fleet_lines, "  ") + textwrap.dedent(extra))
    return str(path)

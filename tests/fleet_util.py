"""Shared pieces of the fleet tests (tests/test_fleet.py, tests/test_fleet_trust.py,
tests/test_trust_peer_replay.py): one layout and namespace, the fleet secret every test node shares,
deterministic block chains, an in-process peer, a polling wait and the config file of a fleet
daemon (the rogue gRPC peer is ``kvstore.ops.forging_peer``)."""

from __future__ import annotations

import textwrap
import time

import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store

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
                       fleet_extra: str = "", ttl_s: float = 1.5, heartbeat_s: float = 0.2,
                       bulk_channel: bool = False, extra: str = "") -> str:
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
        bulk_channel: {str(bulk_channel).lower()}
        fleet:
          enabled: true
          redis_url: {redis_url}
          node_id: {node_id}
          key_prefix: {prefix}
          heartbeat_s: {heartbeat_s}
          ttl_s: {ttl_s}
          peer_timeout_s: 2.0
    """) + textwrap.indent(fleet_lines, "  ") + textwrap.dedent(extra))
    return str(path)

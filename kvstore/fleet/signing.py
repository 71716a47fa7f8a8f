"""Keyed MACs over directory values, under the fleet secret that only daemons hold.

Whoever can write to the fleet's Redis can write any value. A value a daemon acts on (where to
connect, whom to send its peer token, which checksum a peer's bytes must match) must therefore
prove it was written by a daemon: it carries a keyed BLAKE2b (16 bytes) bound to its context, so
a valid value copied under another namespace, slot or block hash does not verify either.

The secret never leaves this object: it is not stored, only the derived key is, and ``repr``
says nothing about either.
"""

from __future__ import annotations

import hashlib
import hmac

from kvstore.errors import InvalidArgument
from kvstore.fleet.records import CHECKSUM_BYTES, HOLDER_PREFIX_BYTES, MAC_BYTES, NodeEntry

MIN_SECRET_BYTES = 16
_NODE = b"kvs-fleet-node"      # BLAKE2b personalisation: a node MAC never verifies as a block MAC
_BLOCK = b"kvs-fleet-block"
_REVOKE = b"kvs-fleet-revoke"


def _secret_bytes(secret) -> bytes:
    if secret is not None and hasattr(secret, "get_secret_value"):   # pydantic SecretStr
        secret = secret.get_secret_value()
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgument("fleet.secret", f"required in fleet mode: the same string of at least "
                                              f"{MIN_SECRET_BYTES} characters on every daemon of the fleet "
                                              "(also KVSTORE_FLEET__SECRET)")
    return secret


class DirectorySigner:
    """Signs what this daemon writes to the directory and checks what it reads there."""

    def __init__(self, secret) -> None:
        self._key = hashlib.blake2b(_secret_bytes(secret), digest_size=32, person=b"kvs-fleet-key").digest()

    def __repr__(self) -> str:
        return "DirectorySigner(<secret>)"

    def _mac(self, person: bytes, *parts: bytes) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES, person=person)
        for part in parts:   # length-prefixed: no two contexts serialise alike
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        return h.digest()

    # -- node entries ----------------------------------------------------------------------------

    def node_mac(self, namespace_id: bytes, slot: int, expiry_ms: int, node_id: str, address: str,
                 epoch: int) -> str:
        text = f"{expiry_ms} {node_id} {address} {epoch}".encode()
        return self._mac(_NODE, namespace_id, str(slot).encode(), text).hex()

    def node_verifies(self, namespace_id: bytes, entry: NodeEntry) -> bool:
        if len(entry.mac) != 2 * MAC_BYTES:
            return False
        want = self._mac(_NODE, namespace_id, str(entry.slot).encode(), entry.signed_text().encode()).hex()
        return hmac.compare_digest(want, entry.mac)

    # -- tombstones -------------------------------------------------------------------------------

    def tombstone_mac(self, namespace_id: bytes, node_id: str, epoch: int, until_ms: int) -> str:
        return self._mac(_REVOKE, namespace_id, f"{node_id} {epoch} {until_ms}".encode()).hex()

    def tombstone_verifies(self, namespace_id: bytes, node_id: str, epoch: int, until_ms: int, mac: str) -> bool:
        return hmac.compare_digest(self.tombstone_mac(namespace_id, node_id, epoch, until_ms), mac)

    # -- block checksums -------------------------------------------------------------------------

    def checksum_prefix(self, namespace_id: bytes, block_hash: bytes, checksum: bytes) -> bytes:
        """The first HOLDER_PREFIX_BYTES of a holders value: the checksum and its MAC."""
        return checksum + self._mac(_BLOCK, namespace_id, block_hash, checksum)

    def checksum_verifies(self, namespace_id: bytes, block_hash: bytes, value: bytes) -> bool:
        """Whether ``value`` starts with a checksum signed for this very block."""
        if len(value) < HOLDER_PREFIX_BYTES:
            return False
        want = self.checksum_prefix(namespace_id, block_hash, value[:CHECKSUM_BYTES])
        return hmac.compare_digest(want, value[:HOLDER_PREFIX_BYTES])

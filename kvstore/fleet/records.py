"""The byte layout of directory values, parsed defensively: anything in Redis may be garbage.

Two kinds of value live in a namespace's directory:

* a **holders** value (one per block): the block's xxh3_64 (8 bytes LE), the MAC that binds that
  checksum to its namespace and block hash (16 bytes), then a bitmap with two bits per node slot,
  "holds it" and "its copy is on disk". Bit ``2 * (slot % 4)`` of byte ``24 + slot // 4``.
* a **node** value (one per slot): ``"<expiry ms> <node id> <address> <epoch> <mac hex>"``, the MAC
  binding all of it to the namespace and the slot. The epoch names one run of the node (random per
  start); peers prove themselves for it (``peer_proof``) and ``leave`` revokes it.
* a **tombstone** (one per departed node run, in the ``revoked`` hash): field ``"<node id> <epoch>"``,
  value ``"<until ms> <mac hex>"``: entries of that run are refused until then.

Parsing never trusts a length, a number or a field count from Redis: a slot outside
``[0, MAX_SLOTS)``, a value without five fields or bytes that are not text are *malformed* and
skipped by the caller; nothing is ever sized by a number read from Redis.
"""

from __future__ import annotations

import dataclasses
import time

TIER_CODES = {"gpu": 0, "cpu": 1, "nvme": 2, "redis": 3}   # >= 2: "disk" in the holders bitmap
CHECKSUM_BYTES = 8
MAC_BYTES = 16
HOLDER_PREFIX_BYTES = CHECKSUM_BYTES + MAC_BYTES   # the bitmap starts here
MAX_SLOTS = 4096   # slots per namespace: bounds every bitmap and every array sized by a slot
_MAX_NODE_VALUE = 1024
_MAX_EPOCH_DIGITS = 20


def pack_entry(checksum: int, tier: str) -> bytes:
    """What this node publishes for one block (its mirror keeps these): checksum LE + tier code."""
    return checksum.to_bytes(CHECKSUM_BYTES, "little") + bytes([TIER_CODES.get(tier, 2)])


def now_ms() -> int:
    """Wall-clock ms. Expiries are written and read with each node's own clock: NTP-level skew
    (milliseconds) is negligible next to ttl_s (seconds)."""
    return int(time.time() * 1000)


def parse_slot(field: bytes | str) -> int | None:
    """A nodes-hash field as a slot number, or None unless it is a canonical decimal below MAX_SLOTS
    (so ``"07"`` or ``"1e3"`` cannot alias slot 7 or 1000)."""
    text = field.decode("ascii", "replace") if isinstance(field, bytes) else field
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_SLOTS)) or str(int(text)) != text:
        return None
    slot = int(text)
    return slot if slot < MAX_SLOTS else None


def _bitmap_byte(slot: int) -> int:
    return HOLDER_PREFIX_BYTES + slot // 4


def marks(value: bytes | None, slot: int) -> bool:
    """Whether either of ``slot``'s two bits is set in a holders value."""
    i = _bitmap_byte(slot)
    return value is not None and len(value) > i and bool(value[i] >> ((slot % 4) * 2) & 3)


def holds(value: bytes | None, slot: int) -> bool:
    """Whether ``slot``'s "holds it" bit is set in a holders value."""
    i = _bitmap_byte(slot)
    return value is not None and len(value) > i and bool(value[i] >> ((slot % 4) * 2) & 1)


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """One slot of the nodes hash as written, before its MAC is checked."""

    slot: int
    expiry_ms: int
    node_id: str
    address: str
    epoch: int
    mac: str        # hex; "" when the value carries none

    def signed_text(self) -> str:
        """The part of the value the MAC covers (with the namespace and the slot)."""
        return f"{self.expiry_ms} {self.node_id} {self.address} {self.epoch}"


def format_node_value(expiry_ms: int, node_id: str, address: str, epoch: int, mac: str) -> str:
    return f"{expiry_ms} {node_id} {address} {epoch} {mac}"


def _digits(text: str, most: int) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= most


def parse_node_entry(slot: int, value: bytes | str) -> NodeEntry | None:
    """The fields of a node value, or None when it is not ``"<digits> <id> <address> <digits> [<mac>]"``."""
    if isinstance(value, bytes):
        if len(value) > _MAX_NODE_VALUE:
            return None
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    parts = value.split(" ")
    if len(parts) not in (4, 5) or not all(parts[1:3]):
        return None
    if not _digits(parts[0], 15) or not _digits(parts[3], _MAX_EPOCH_DIGITS):
        return None
    return NodeEntry(slot, int(parts[0]), parts[1], parts[2], int(parts[3]), parts[4] if len(parts) == 5 else "")


def parse_tombstone(field: bytes | str, value: bytes | str) -> tuple[str, int, int, str] | None:
    """``(node id, epoch, until ms, mac hex)`` of a tombstone, or None when it is malformed."""
    try:
        field = field.decode("ascii") if isinstance(field, bytes) else field
        value = value.decode("ascii") if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        return None
    if len(field) > _MAX_NODE_VALUE or len(value) > _MAX_NODE_VALUE:
        return None
    node = field.split(" ")
    fields = value.split(" ")
    if len(node) != 2 or len(fields) != 2 or not node[0] or not _digits(node[1], _MAX_EPOCH_DIGITS):
        return None
    if not _digits(fields[0], 15):
        return None
    return node[0], int(node[1]), int(fields[0]), fields[1]

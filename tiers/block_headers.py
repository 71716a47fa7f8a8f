"""The NVMe tier's block header: what a slot's first page and its row in the slab's record file
hold (the block's record and two checksums), encoded, decoded one by one (a read verifies its
slot's header) or in bulk (a warm restart decodes every row of a record file at once), and found
again from outside the daemon (``find_blocks``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import numpy as np
import xxhash

from kvstore.keys import NAMESPACE_ID_BYTES
from kvstore.tiers.base import BlockRecord
from kvstore.tiers.private_files import NotRegularFile, open_regular
from kvstore.tiers.slabs import RECORD_BYTES, SLAB_NAME

ALIGN = 4096          # a page: slots, headers and payloads are padded to it (O_DIRECT)
HEADER_BYTES = 4096
MAGIC = b"KVSBLK02"
_HEADER = struct.Struct("<8s16sB64sB64sHQQQ")  # magic ns hash_len hash parent_len parent codec raw stored sum
_HEADER_SUM = struct.Struct("<Q")
#: a header's bytes that matter: its fields and their checksum (the rest of its page is zeros)
SUMMED_BYTES = _HEADER.size + _HEADER_SUM.size
#: ``_HEADER`` and its checksum as numpy sees one row of a record file
_ROW = np.dtype({"names": ["magic", "ns", "hlen", "plen", "codec", "raw", "stored", "sum", "hsum"],
                 "formats": ["S8", "V16", "u1", "u1", "<u2", "<u8", "<u8", "<u8", "<u8"],
                 "offsets": [0, 8, 24, 89, 154, 156, 164, 172, _HEADER.size], "itemsize": RECORD_BYTES})
_HASH_AT, _PARENT_AT, _MAX_HASH = 25, 90, 64
_NS_AT, _NS_BYTES = 8, NAMESPACE_ID_BYTES


def encode_header(r: BlockRecord) -> bytes:
    parent = r.parent_hash or b""
    body = _HEADER.pack(MAGIC, r.namespace_id, len(r.block_hash), r.block_hash, len(parent), parent,
                        r.codec, r.raw_size, r.stored_size, r.checksum)
    return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(buf: bytes) -> BlockRecord:
    """Parse a header; ValueError if it is not one of ours or is damaged."""
    if len(buf) < _HEADER.size + _HEADER_SUM.size:
        raise ValueError(f"header is {len(buf)} bytes (torn or empty file)")
    body = bytes(buf[:_HEADER.size])
    (want,) = _HEADER_SUM.unpack_from(buf, _HEADER.size)
    if xxhash.xxh3_64_intdigest(body) != want:
        raise ValueError("header checksum mismatch")
    magic, ns, hlen, h, plen, p, codec, raw, stored, checksum = _HEADER.unpack(body)
    if magic != MAGIC:
        raise ValueError("bad magic")
    return BlockRecord(ns, h[:hlen], p[:plen] if plen else None, stored, raw, codec, checksum)


class DecodedRows:
    """The rows of a record file decoded at once (``decode_headers``), as column lists, one item
    per row: ``intact`` (an intact header of ours; the other columns are meaningless where not),
    ``keys``, ``parent_keys`` (None: a chain's head), ``stored_sizes``, ``raw_sizes``, ``codecs``,
    ``checksums`` (the payloads')."""

    __slots__ = ("intact", "keys", "parent_keys", "stored_sizes", "raw_sizes", "codecs", "checksums")

    def __init__(self, intact, keys, parent_keys, stored_sizes, raw_sizes, codecs, checksums) -> None:
        self.intact, self.keys, self.parent_keys = intact, keys, parent_keys
        self.stored_sizes, self.raw_sizes, self.codecs, self.checksums = stored_sizes, raw_sizes, codecs, checksums


def decode_headers(rows: np.ndarray) -> DecodedRows:
    """``decode_header`` of each row of ``rows`` (one record file row of ``RECORD_BYTES`` each), in
    bulk: numpy reads the fields of every row at once, and only the header checksum and the
    keys are made per row (no record object: a warm restart of millions of blocks keeps none)."""
    n = len(rows)
    if n == 0:
        return DecodedRows([], [], [], [], [], [], [])
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    fields = rows.view(_ROW).reshape(n)
    size = _HEADER.size
    bodies = rows[:, :size].tobytes()
    xxh = xxhash.xxh3_64_intdigest
    ours = (fields["magic"] == MAGIC).tolist()
    intact = [mine and xxh(bodies[i * size:(i + 1) * size]) == want
              for i, (mine, want) in enumerate(zip(ours, fields["hsum"].tolist()))]
    parents = [p if len(p) > _NS_BYTES else None for p in _keys(rows, _PARENT_AT, fields["plen"])]
    return DecodedRows(intact, _keys(rows, _HASH_AT, fields["hlen"]), parents, fields["stored"].tolist(),
                       fields["raw"].tolist(), fields["codec"].tolist(), fields["sum"].tolist())


def _keys(rows: np.ndarray, at: int, lengths: np.ndarray) -> list[bytes]:
    """Per row ``block_key`` of its namespace id and the hash from ``at`` on, as long as its
    length says (at most ``_MAX_HASH``; a length of 0 gives the id alone): with one slice when
    every row's length is the same or 0 (a tier's blocks share a hash size; a chain's head has no
    parent hash). Keys are made straight from the rows: no hash is made apart from its key."""
    lengths = np.minimum(lengths, _MAX_HASH)
    ns = rows[:, _NS_AT:_NS_AT + _NS_BYTES]
    sizes = lengths[lengths > 0]   # (not np.unique: its first call imports numpy.ma, counted in a restart's bytes)
    if not len(sizes) or (sizes == sizes[0]).all():
        size = _NS_BYTES + (int(sizes[0]) if len(sizes) else 0)
        keys = np.concatenate([ns, rows[:, at:at + size - _NS_BYTES]], axis=1).view(f"V{size}").reshape(-1).tolist()
        if len(sizes) < len(lengths):   # the id alone where a row's length is 0
            keys = [key if n else key[:_NS_BYTES] for key, n in zip(keys, lengths.tolist())]
        return keys
    return [ns[i].tobytes() + rows[i, at:at + size].tobytes() for i, size in enumerate(lengths.tolist())]


def find_blocks(directory: str) -> dict[bytes, tuple[str, int]]:
    """Where each block with an intact header lies in a tier's directory, read from outside the
    daemon (inspection, and tests that damage blocks on disk): key -> (slab file, offset of its
    header). Like recovery it reads headers at slot starts only, and opens regular files only."""
    found: dict[bytes, tuple[str, int]] = {}
    for name in sorted(os.listdir(directory)):
        m = SLAB_NAME.fullmatch(name)
        if m is None:
            continue
        path, slot_bytes = os.path.join(directory, name), int(m.group(1))
        try:
            fd = open_regular(path)
        except (NotRegularFile, OSError):
            continue
        try:
            page = np.empty(HEADER_BYTES, np.uint8)
            for slot, record, _ in _slot_headers(fd, os.fstat(fd).st_size // slot_bytes, slot_bytes, page):
                if record is not None:
                    found.setdefault(record.key, (path, slot * slot_bytes))
        finally:
            os.close(fd)
    return found


def _slot_headers(fd: int, count: int, slot_bytes: int, page) -> Iterator[tuple[int, BlockRecord | None, bool]]:
    """``(slot, record or None, damaged)`` for the first ``count`` slots of a slab, read into
    ``page`` (page-aligned where ``fd`` is O_DIRECT) at slot starts only; ``damaged``: the slot
    holds bytes where its header should be that are not a valid header."""
    view = memoryview(page)[:HEADER_BYTES]
    for slot in range(count):
        try:
            got = os.preadv(fd, [view], slot * slot_bytes)
        except OSError:
            yield slot, None, False
            continue
        if got < HEADER_BYTES:
            yield slot, None, False
            continue
        try:
            yield slot, decode_header(page[:HEADER_BYTES]), False
        except ValueError:
            yield slot, None, bool(np.any(np.frombuffer(view, np.uint8)))

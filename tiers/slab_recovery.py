"""What a warm restart finds in an NVMe tier's directory: its slab files, and the intact records
in each (the tier adopts them, ``NvmeTier.recover``).

Recovery never follows a symlink or waits on a FIFO named like a slab: it skips it, leaves it
there and counts it. Files of the older one-file-per-block layout (``*.kvb``) and record files
without their slab are deleted (a cache loses nothing it cannot recompute); anything else named
so is skipped and counted the same way. A record that is damaged, names a block already found,
does not fit the slab's slot size or the tier's room, or (with ``verify``) does not match its
slot, has its slot erased and is counted as dropped.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from kvstore.buffers import Scratch
from kvstore.errors import TierIOError
from kvstore.tiers.base import RecoveredBlocks
from kvstore.tiers.block_headers import ALIGN, HEADER_BYTES, SUMMED_BYTES, decode_headers
from kvstore.tiers.private_files import NotRegularFile, file_kind, open_regular, unlink_quietly
from kvstore.tiers.slabs import RECORD_BYTES, RECORDS_NAME, SLAB_NAME, Slab, records_path

log = logging.getLogger("kvstore.tiers.nvme")

LEGACY_SUFFIXES = (".kvb", ".kvb.tmp")   # the one-file-per-block layout before slabs


class SlabFinder:
    """Finds the slabs of one tier directory and their intact records, counting what it skips
    (``take_skipped``: not regular files) and drops (``take_dropped``: damaged records)."""

    def __init__(self, directory: str, o_direct: bool, verify: bool, staging: Scratch) -> None:
        self.directory = directory
        self.o_direct = o_direct
        self.verify = verify
        self._staging = staging   # page-aligned: slots are read with O_DIRECT
        self._skipped = 0
        self._dropped = 0

    def take_skipped(self) -> int:
        n, self._skipped = self._skipped, 0
        return n

    def take_dropped(self) -> int:
        n, self._dropped = self._dropped, 0
        return n

    def slabs(self, known: Callable[[int], bool]) -> Iterator[tuple[Slab, bool]]:
        """Each slab file of the directory, opened read-only, with whether its record file had to
        be made anew (its records are then rebuilt from its slots' headers). ``known(slot_bytes)``:
        the tier has a slab of that size already (a second one is a copy, left alone)."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as e:
            raise TierIOError(f"nvme tier: cannot list {self.directory}: {e.strerror}") from e
        present = set(names)
        for name in names:
            path = os.path.join(self.directory, name)
            m = SLAB_NAME.fullmatch(name)
            if m is None:
                if name.endswith(LEGACY_SUFFIXES) or (RECORDS_NAME.fullmatch(name)
                                                      and name[:-len(".kvi")] + ".kvs" not in present):
                    self._remove_leftover(path)   # the old layout's files; a record file without its slab
                continue
            fp = int(m.group(1))
            if fp < 2 * ALIGN or fp % ALIGN:
                continue   # not a name this tier makes
            if known(fp):   # this tier never makes two for one size: a copy, left alone
                log.warning("nvme tier: skipped %s at recovery: a second slab of %d-byte slots", path, fp)
                continue
            fds = self._open_slab_files(path)
            if fds is None:
                continue
            slab = Slab(self.directory, fp, self.o_direct, path=path)
            slab.open(*fds)
            rebuild = slab.records_fd < 0
            if rebuild:
                try:
                    slab.create_records()
                except OSError as e:
                    log.warning("nvme tier: skipped %s at recovery: cannot create its record file: %s", path,
                                e.strerror)
                    slab.close()
                    continue
            yield slab, rebuild

    def _open_slab_files(self, path: str) -> tuple[int, int | None] | None:
        """Read-only descriptors of a slab and its record file (None: it has none yet), or None
        when either is not a regular file or cannot be opened (skipped, left in place)."""
        fd = -1
        try:
            fd = open_regular(path, os.O_DIRECT if self.o_direct else 0)
            try:
                return fd, open_regular(records_path(path))
            except FileNotFoundError:
                return fd, None
        except NotRegularFile as e:
            self._skipped += 1
            log.warning("nvme tier: skipped %s at recovery: it is a %s, not a slab file", e.path, e.kind)
        except OSError as e:
            log.warning("nvme tier: skipped %s at recovery: %s", path, e.strerror)
        if fd >= 0:
            os.close(fd)
        return None

    def _remove_leftover(self, path: str) -> None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return
        if not stat.S_ISREG(mode):
            self._skipped += 1
            log.warning("nvme tier: skipped %s at recovery: it is a %s, not a file this tier wrote", path,
                        file_kind(mode))
            return
        unlink_quietly(path)

    def intact(self, slab: Slab, rebuild: bool, room: int, taken: Callable[[bytes], bool],
               shared: dict) -> tuple[RecoveredBlocks, list[int], int]:
        """The intact blocks of one slab, their slots (in the same order) and its slot count, from
        its records, decoded at once (``decode_headers``); with ``verify`` each slot is read as
        well and must hold the same header and a payload that matches its checksum. The slab
        keeps their checksums (``Slab.set_checksums``). ``rebuild``: its record file is new, so
        its records come from the headers at its slot starts, and are written. ``room``: bytes
        the tier has left; ``taken(key)``: a block the tier holds already. ``shared``: equal keys
        and sizes are made one object (an index of millions holds them; a child's parent key is
        its parent's key)."""
        count = os.fstat(slab.fd).st_size // slab.slot_bytes
        rows = self._slot_header_rows(slab, count) if rebuild else slab.read_records(count)
        flat = memoryview(rows).cast("B")
        page = self._staging.get(slab.slot_bytes if self.verify else HEADER_BYTES)
        found = RecoveredBlocks([], [], [], [], [])
        slots: list[int] = []
        sums: list[int] = []
        keys: set[bytes] = set()
        used = np.flatnonzero(rows.any(axis=1))
        d = decode_headers(rows[used])
        share = shared.setdefault
        for slot, ok, key, parent, stored, raw, codec, checksum in zip(
                used.tolist(), d.intact, d.keys, d.parent_keys, d.stored_sizes, d.raw_sizes, d.codecs, d.checksums):
            at = slot * RECORD_BYTES
            if (not ok or HEADER_BYTES + -(-stored // ALIGN) * ALIGN != slab.slot_bytes
                    or key in keys or taken(key) or room < slab.slot_bytes
                    or (self.verify and not self._slot_intact(slab, slot, flat[at:at + RECORD_BYTES], stored,
                                                              checksum, page))):
                self._dropped += 1
                rows[slot] = 0
                slab.punch([slot])
                continue
            keys.add(key)
            room -= slab.slot_bytes
            found.keys.append(share(key, key))
            found.parent_keys.append(None if parent is None else share(parent, parent))
            found.raw_sizes.append(share(raw, raw))
            found.stored_sizes.append(share(stored, stored))
            found.codecs.append(codec)
            slots.append(slot)
            sums.append(checksum)
        slab.set_checksums(slots, sums)
        if rebuild:
            slab.write_records(rows)
        return found, slots, count

    def _slot_header_rows(self, slab: Slab, count: int) -> np.ndarray:
        """The headers at the slot starts of a slab without a record file, one row each, as its
        records would hold them (a header page with bytes past a row's end is marked damaged)."""
        rows = np.zeros((count, RECORD_BYTES), np.uint8)
        page = self._staging.get(HEADER_BYTES)
        view = memoryview(page)[:HEADER_BYTES]
        arr = np.frombuffer(view, np.uint8)
        for slot in range(count):
            try:
                got = os.preadv(slab.fd, [view], slab.offset(slot))
            except OSError:
                continue
            if got < HEADER_BYTES:
                continue
            rows[slot] = arr[:RECORD_BYTES]
            if arr[RECORD_BYTES:].any():
                rows[slot, 0] ^= 0xFF   # not a header of ours: decoding it fails
        return rows

    def _slot_intact(self, slab: Slab, slot: int, row, stored: int, checksum: int, page) -> bool:
        """Whether ``slot`` holds the header ``row`` and a ``stored``-byte payload matching ``checksum``."""
        view = memoryview(page)
        try:
            got = os.preadv(slab.fd, [view[:slab.slot_bytes]], slab.offset(slot))
        except OSError:
            return False
        return (got >= HEADER_BYTES + stored and view[:SUMMED_BYTES] == row[:SUMMED_BYTES]
                and xxhash.xxh3_64_intdigest(view[HEADER_BYTES:HEADER_BYTES + stored]) == checksum)

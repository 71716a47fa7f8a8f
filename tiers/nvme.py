"""NVMe tier: checksummed blocks in slab files in a local directory, found again after a restart.

Layout: one slab file per block footprint (``slab-<footprint>-<random>.kvs``, see ``slabs``), one block
per slot. A slot = a 4 KiB header (record + xxh3 of the payload + xxh3 of the header) followed by
the payload padded to 4 KiB, so a block moves with one O_DIRECT ``pwritev`` / ``preadv`` at its
slot's offset (buffered I/O where the filesystem refuses O_DIRECT, e.g. tmpfs), and its header
again into the slab's record file (``slabs``). No file is created, renamed or unlinked per block:
that metadata work cost more than the bytes at 64 KiB.

Durable: ``write`` is a positional write and an ``fdatasync``. The batched form
(``write_unsynced`` + ``sync``) flushes each slab written since the last ``sync`` once (group
commit), and the directory once when a slab file was created. A crash before then may lose or
tear such a block; the header's and payload's checksums turn a torn or mixed slot (a reused
slot half overwritten) into a counted miss. Dropping a block forgets it at once (no I/O: the
store drops under its lock); ``finish_drops``, run without the store lock, then punches its slot
out of the file (its header reads back as zeros) and only then hands the slot out again, so a
restart does not bring it back and no new block sits behind its stale header. Where that cannot
be made durable in time (a crash right after the drop) the old block may come back, whole and
checksummed. Every read verifies the header (its key and footprint must match) and the payload
checksum; a bad slot is dropped, counted and reported as ``BlockCorrupt`` (the store turns that
into a miss). Warm restart: ``recover()`` rebuilds the index from the record files, one read
per slab (``slab_recovery``); each record's header checksum is checked then, each slot when it is read.
A recovered block is held as a row of its slab's columns (``recovered_rows``), not as a record.

Planted files (see ``private_files``): the directory is created 0700 and an existing one must be
ours and private (an empty loose one is tightened to 0700, a loose one with entries is refused);
slab and probe files are created 0600 with ``O_EXCL|O_NOFOLLOW`` (a slab under a random name, so
nothing planted beforehand can hold it), and a symlink planted under a probe's name is replaced,
never written through. The tier keeps each slab open, so a file swapped in under a slab's name
while it serves is never read. What recovery skips, deletes and counts: see ``slab_recovery``.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np
import xxhash

from kvstore.errors import BlockCorrupt, BlockTooLarge, TierFull, TierIOError
from kvstore.tiers.base import BlockRecord, RecoveredBlocks, Tier
from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch, as_bytes
from kvstore.tiers.block_headers import ALIGN, HEADER_BYTES, decode_header, encode_header
from kvstore.tiers.block_headers import find_blocks  # noqa: F401 (where inspection and tests find it)
from kvstore.tiers.private_files import claim_private_dir, create_exclusive, fsync_dir, unlink_quietly
from kvstore.tiers.recovered_rows import RecoveredRows
from kvstore.tiers.slab_recovery import SlabFinder
from kvstore.tiers.slabs import Slab


MAX_SLABS = 64   # distinct block footprints at once (a slab file and descriptor each)
# Neighbouring slots read with one preadv, up to this many bytes: one large read costs the disk
# about what one small one does, so at 64 KiB a run of 16 moves several times the bytes per call.
READ_RUN_BYTES = 1 << 20
# Blocks written together (demotions reserved as a batch) go down in one pwritev of up to this
# many bytes and blocks (two pieces each, within the kernel's 1,024 per call).
WRITE_RUN_BYTES = 4 << 20
WRITE_RUN_BLOCKS = 512


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def o_direct_supported(directory: str) -> bool:
    """Whether ``directory``'s filesystem accepts O_DIRECT writes (tmpfs before Linux 6.6 and
    some network filesystems do not): probed with one aligned page."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    try:
        fd = create_exclusive(probe, os.O_DIRECT)
    except OSError:
        unlink_quietly(probe)  # some filesystems create the file, then refuse O_DIRECT
        return False
    try:
        os.write(fd, mmap.mmap(-1, ALIGN))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


class NvmeTier(Tier):
    name = "nvme"
    durable = True

    def __init__(self, path: str, capacity_bytes: int, use_o_direct: bool = True,
                 verify_on_recover: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.path = os.path.abspath(path)
        self.verify_on_recover = verify_on_recover
        self.recovery_skipped_not_regular = 0
        try:
            claim_private_dir(self.path, "nvme tier")
            probe = os.path.join(self.path, ".write-probe")
            fd = create_exclusive(probe)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise TierIOError(f"nvme tier: directory {self.path} is not writable: {e.strerror}") from e
        self.o_direct = use_o_direct and o_direct_supported(self.path)
        self._blocks: dict[bytes, BlockRecord] = {}   # key -> record (its slot in ``record.slot``)
        #: the blocks found at start-up and still held, per slab (never also in ``_blocks``);
        #: replaced whole under ``_lock``, so a reader without it walks one consistent tuple
        self._recovered: tuple[RecoveredRows, ...] = ()
        self._slabs: dict[int, Slab] = {}   # footprint -> its slab
        self._lock = threading.Lock()
        self._to_punch: list[tuple[bytes, Slab, int]] = []   # dropped, slot not yet erased: (key, slab, slot)
        self._unflushed: set[Slab] = set()   # slabs written without a flush since the last sync()
        self._written: set[Slab] = set()     # slabs written at all since the last sync()
        self._new_files = False              # a slab file created since the last directory fsync
        self.file_fsyncs = 0          # payloads flushed one by one (``write``)
        self.filesystem_flushes = 0   # ``sync()``s that flushed payloads written without one (group commits)
        # one page-aligned, touched staging buffer per thread (O_DIRECT needs alignment); an
        # oversized block's is freed after use rather than kept by every thread that wrote one
        self._staging = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)

    # -- where blocks are ------------------------------------------------------------------------

    def _where(self, key: bytes) -> tuple[int, Slab, int]:
        """(stored size, slab, slot) of a block held (``KeyError`` if not): a block lies in the one
        slab of its footprint, at its record's slot, or at its recovered row's."""
        record = self._blocks.get(key)
        if record is not None:
            return record.stored_size, self._slabs[HEADER_BYTES + _round_up(record.stored_size)], record.slot
        rows, row = self._recovered_row(key)
        stored, slot = rows.where(row)
        return stored, rows.slab, slot

    def _recovered_row(self, key: bytes) -> tuple[RecoveredRows, int]:
        """The recovered rows holding ``key`` and its row there (``KeyError`` if none)."""
        for rows in self._recovered:
            row = rows.find(key)
            if row >= 0:
                return rows, row
        raise KeyError(key)

    def _holds(self, key: bytes) -> bool:
        if key in self._blocks:
            return True
        try:
            self._recovered_row(key)
        except KeyError:
            return False
        return True

    def location(self, key: bytes) -> tuple[str, int]:
        """(slab file, byte offset of the block's header): where a block lies, for inspection."""
        _, slab, slot = self._where(key)
        return slab.path, slab.offset(slot)

    # -- contract --------------------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        fp = HEADER_BYTES + _round_up(nbytes)
        if fp > self.capacity_bytes:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the nvme tier ({self.capacity_bytes} bytes)")
        return fp

    def allocate(self, record: BlockRecord) -> None:
        fp = self.footprint(record.stored_size)
        with self._lock:
            if self._holds(record.key):
                raise KeyError(f"{record.key.hex()} already in nvme tier")
            if fp > self.free_bytes:
                raise TierFull(f"nvme tier has {self.free_bytes} free bytes, needs {fp}")
            slab = self._slab_for(fp)
            record.slot = slab.take()
            self._blocks[record.key] = record
            self.used_bytes += fp

    def _slab_for(self, fp: int) -> Slab:
        slab = self._slabs.get(fp)
        if slab is None:
            if len(self._slabs) >= MAX_SLABS:
                raise TierFull(f"nvme tier holds blocks of {MAX_SLABS} different sizes already")
            slab = self._slabs[fp] = Slab(self.path, fp, self.o_direct)
        return slab

    def write(self, record: BlockRecord, data) -> None:
        self.write_unsynced(record, data)
        self.sync()

    def write_unsynced(self, record: BlockRecord, data, durable: bool = True) -> None:
        """Write one reserved block into its slot; ``durable``: flushed before returning (the slab's
        new directory entry, if any, waits for ``sync()``). ``durable=False``: ``sync()`` flushes it."""
        _, slab, slot = self._where(record.key)
        _, error = self._write_run(slab, slot, [record], [data], durable)
        if error is not None:
            raise error

    def write_many_unsynced(self, records: list[BlockRecord], datas: list, durable: bool = True) -> list:
        """``write_unsynced`` for each reserved block; blocks in neighbouring slots of one slab (a
        batch of demotions reserved together) go to disk with one ``pwritev`` of up to
        ``WRITE_RUN_BYTES`` and one write of their records. Per block None, or the ``TierIOError``
        its write raised (the block dropped; a run that fails part way keeps the blocks that landed
        whole before the failure, as writing them one by one would)."""
        with self._lock:
            where = [self._where(r.key) for r in records]
        got: list = [None] * len(records)
        i = 0
        while i < len(records):
            _, slab, slot = where[i]
            j = i + 1
            while (j < len(records) and where[j][1] is slab and where[j][2] == slot + (j - i)
                   and (j - i + 1) * slab.slot_bytes <= WRITE_RUN_BYTES and j - i < WRITE_RUN_BLOCKS):
                j += 1
            landed, error = self._write_run(slab, slot, records[i:j], datas[i:j], durable)
            got[i + landed:j] = [error] * (j - i - landed)
            i = j
        return got

    def _write_run(self, slab: Slab, first: int, records: list[BlockRecord], datas: list,
                   durable: bool) -> tuple[int, TierIOError | None]:
        """Blocks reserved in consecutive slots from ``first``: headers and payloads in one
        ``pwritev``, then their records. How many landed (the leading blocks written whole before
        a failure, kept), and the failure (the blocks after them dropped), if any."""
        landed, failure = 0, None
        try:
            if os.fstat(self._open(slab)).st_nlink == 0:
                raise OSError(errno.ENOENT, "its slab file was removed")
            pieces, headers = self._slot_pieces(records, datas)
            fd = slab.writer()
            try:
                try:
                    _pwritev_all(fd, pieces, slab.offset(first))
                    landed = len(records)
                except _ShortWrite as e:
                    landed, failure = _whole_blocks(records, e.written), e.error
                    for record in records[landed:]:   # their space back first: the records of
                        self.drop(record.key)         # the blocks that landed may need a page
                    self.finish_drops()
                if durable and landed:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if landed:
                slab.write_records_at(first, headers[:landed], durable)
                with self._lock:   # writers run on several threads (a put's disk writes in flight)
                    slab.set_checksums(range(first, first + landed), [r.checksum for r in records[:landed]])
                    self._written.add(slab)
                    if durable:
                        self.file_fsyncs += landed
                    else:
                        self._unflushed.add(slab)
        except OSError as e:
            landed, failure = 0, e
        if failure is None:
            return landed, None
        for record in records[landed:]:
            self.drop(record.key)
        cause = "disk full" if failure.errno == errno.ENOSPC else failure.strerror
        error = TierIOError(f"nvme tier: writing to {self.path} failed: {cause}")
        error.__cause__ = failure
        return landed, error

    def _open(self, slab: Slab) -> int:
        if slab.fd >= 0:
            return slab.fd
        with self._lock:
            if slab.fd < 0:
                slab.open()
                self._new_files = True
            return slab.fd

    def sync(self) -> None:
        """Make every write so far durable: one flush per slab written without one
        (``durable=False``), then one directory fsync if a slab file was created, for a whole batch."""
        with self._lock:
            unflushed, self._unflushed = list(self._unflushed), set()
            written, self._written = list(self._written), set()
            new_files, self._new_files = self._new_files, False
        try:
            for slab in unflushed:
                if slab.fd >= 0:
                    slab.flush()
            if unflushed:
                with self._lock:
                    self.filesystem_flushes += 1
            if new_files:
                fsync_dir(self.path)
            if not all(slab.linked() for slab in written):
                raise OSError(errno.ENOENT, "a slab file was removed or replaced")
        except OSError as e:
            with self._lock:
                self._unflushed.update(unflushed)
                self._written.update(written)
                self._new_files = self._new_files or new_files
            raise TierIOError(f"nvme tier: flushing {self.path} failed: {e.strerror}") from e

    def _slot_pieces(self, records: list[BlockRecord], datas: list) -> tuple[list[memoryview], list[bytes]]:
        """What a ``pwritev`` of consecutive slots writes, and each block's header. A page-aligned
        payload (CPU-arena slots, pooled server buffers) goes to disk straight from where it is;
        anything else is copied once into the thread's aligned staging buffer, which O_DIRECT needs."""
        plans, staged = [], 0
        for record, data in zip(records, datas):
            src = as_bytes(data)[:record.stored_size]
            if not record.checksum:
                record.checksum = xxhash.xxh3_64_intdigest(src)
            n = record.stored_size
            direct = _round_up(n) == n and _page_aligned(src)
            plans.append((src, n, direct, staged))
            staged += HEADER_BYTES + (0 if direct else _round_up(n))
        stage = self._staging.get(staged)
        arr = np.frombuffer(stage, dtype=np.uint8, count=staged)
        view = memoryview(stage)
        pieces: list[memoryview] = []
        headers: list[bytes] = []
        for record, (src, n, direct, at) in zip(records, plans):
            header = encode_header(record)
            headers.append(header)
            arr[at:at + HEADER_BYTES] = 0
            arr[at:at + len(header)] = np.frombuffer(header, dtype=np.uint8)
            if direct:
                pieces += [view[at:at + HEADER_BYTES], memoryview(src)]
            else:
                padded = _round_up(n)
                np.copyto(arr[at + HEADER_BYTES:at + HEADER_BYTES + n], src)
                arr[at + HEADER_BYTES + n:at + HEADER_BYTES + padded] = 0
                pieces.append(view[at:at + HEADER_BYTES + padded])
        return pieces, headers

    def read_into(self, key: bytes, out) -> int:
        """Verified read. A page-aligned ``out`` with room for the padded payload is filled by the
        disk directly (no staging copy); if verification then fails its contents are undefined
        and ``BlockCorrupt`` says so: the caller treats it as a miss."""
        n, slab, slot = self._where(key)
        padded = _round_up(n)
        dst = as_bytes(out)
        direct = _lands_in_place(dst, n)
        stage = self._staging.get(HEADER_BYTES + (0 if direct else padded))
        if slab.fd < 0:
            self._corrupt(key, "its slab file was never written")
        try:
            if direct:
                got = os.preadv(slab.fd, [memoryview(stage)[:HEADER_BYTES], memoryview(dst[:n])], slab.offset(slot))
                payload = dst[:n]
            else:
                got = os.preadv(slab.fd, [memoryview(stage)[:HEADER_BYTES + padded]], slab.offset(slot))
                payload = np.frombuffer(stage, dtype=np.uint8, count=n, offset=HEADER_BYTES)
        except OSError as e:
            self._corrupt(key, f"read failed: {e.strerror}")
        if got < HEADER_BYTES + n:
            self._corrupt(key, f"truncated ({got} of {HEADER_BYTES + padded} bytes)")
        self._verify(key, slab, stage[:HEADER_BYTES], payload)
        if not direct:
            np.copyto(dst[:n], payload)
        return n

    reads_in_runs = True

    def read_many_into(self, keys, outs) -> list:
        """``read_into`` for each key; blocks in neighbouring slots of one slab (a chain stored in
        one go) are read with one ``preadv`` of up to ``READ_RUN_BYTES``, each still verified on
        its own. In each key's place its length, or the ``BlockCorrupt`` / ``KeyError`` raised."""
        got: list = [None] * len(keys)
        i = 0
        while i < len(keys):
            j = self._run_end(keys, i)
            run = self._read_run if j - i > 1 else super().read_many_into
            got[i:j] = run(keys[i:j], outs[i:j])
            i = j
        return got

    def _run_end(self, keys, i: int) -> int:
        """The end of the run from ``keys[i]``: each next block in the slot after the last's."""
        try:
            _, slab, slot = self._where(keys[i])
        except KeyError:
            return i + 1
        j, nbytes = i + 1, slab.slot_bytes
        while j < len(keys) and nbytes + slab.slot_bytes <= READ_RUN_BYTES:
            try:
                _, nxt_slab, nxt_slot = self._where(keys[j])
            except KeyError:
                break
            if nxt_slab is not slab or nxt_slot != slot + 1:
                break
            slot, nbytes, j = slot + 1, nbytes + slab.slot_bytes, j + 1
        return j

    def _read_run(self, keys, outs) -> list:
        """One preadv for blocks in consecutive slots: headers (and any payload that cannot land
        in its caller's buffer directly) into staging, the rest straight into the callers' buffers."""
        entries = [self._where(k) for k in keys]
        slab, first = entries[0][1], entries[0][2]
        plans, pieces, staged = [], [], 0
        for (n, _, _), out in zip(entries, outs):
            padded = _round_up(n)
            dst = as_bytes(out)
            direct = _lands_in_place(dst, n)
            plans.append((n, padded, dst, direct, staged))
            staged += HEADER_BYTES + (0 if direct else padded)
        stage = self._staging.get(staged)
        view = memoryview(stage)
        for n, padded, dst, direct, at in plans:
            pieces.append(view[at:at + HEADER_BYTES])
            pieces.append(memoryview(dst[:n]) if direct else view[at + HEADER_BYTES:at + HEADER_BYTES + padded])
        try:
            done = os.preadv(slab.fd, pieces, slab.offset(first))
        except OSError:
            done = 0   # each block is read again on its own below, and judged there
        got: list = []
        end = 0
        for key, (n, padded, dst, direct, at) in zip(keys, plans):
            end += slab.slot_bytes
            try:
                if done < end - padded + n:
                    got.append(self.read_into(key, dst))   # cut short: this one alone, judged alone
                    continue
                header = stage[at:at + HEADER_BYTES]
                payload = dst[:n] if direct else stage[at + HEADER_BYTES:at + HEADER_BYTES + n]
                self._verify(key, slab, header, payload)
                if not direct:
                    np.copyto(dst[:n], payload)
                got.append(n)
            except (KeyError, BlockCorrupt) as e:
                got.append(e)
        return got

    def _verify(self, key: bytes, slab: Slab, header, payload) -> None:
        """``BlockCorrupt`` (the block dropped) unless the slot holds this key's intact block."""
        try:
            on_disk = decode_header(header)
        except ValueError as e:
            self._corrupt(key, str(e))
        if (on_disk.key != key or HEADER_BYTES + _round_up(on_disk.stored_size) != slab.slot_bytes
                or xxhash.xxh3_64_intdigest(payload) != on_disk.checksum):
            self._corrupt(key, "payload checksum mismatch")

    def _corrupt(self, key: bytes, why: str):
        self.corrupt_dropped += 1
        self.drop(key)
        raise BlockCorrupt(f"nvme block {key.hex()[:24]}... dropped: {why}")

    def drop(self, key: bytes) -> None:
        """Forget the block; its slot stays taken until ``finish_drops`` has erased it."""
        with self._lock:
            if key in self._blocks:
                _, slab, slot = self._where(key)
                del self._blocks[key]
            else:
                try:
                    rows, row = self._recovered_row(key)
                except KeyError:
                    return
                slab, slot = rows.slab, rows.drop(row)
                if not rows:
                    self._recovered = tuple(r for r in self._recovered if r is not rows)
            self.used_bytes -= slab.slot_bytes
            self._to_punch.append((key, slab, slot))

    def finish_drops(self) -> None:
        """Erase the slots of the blocks dropped so far (``punch``), then free them; a slab left
        without blocks is removed, so sizes no longer stored do not count against ``MAX_SLABS``."""
        if not self._to_punch:
            return
        with self._lock:
            punching, self._to_punch = self._to_punch, []
        by_slab: dict[Slab, list[tuple[bytes, int]]] = {}
        for key, slab, slot in punching:
            by_slab.setdefault(slab, []).append((key, slot))
        for slab, dropped in by_slab.items():
            self.punch(slab, dropped)
        with self._lock:
            for _, slab, slot in punching:
                slab.give_back(slot)
                if not slab.used:
                    self._retire(slab)

    def punch(self, slab: Slab, dropped: list[tuple[bytes, int]]) -> None:
        """Erase the slots of ``slab``'s dropped blocks (``(key, slot)`` each) on disk, together
        (``Slab.punch``): a slot's next block never sits behind a stale header, and a restart does
        not bring a dropped block back."""
        slab.punch([slot for _, slot in dropped])

    def _retire(self, slab: Slab) -> None:
        """Forget an empty slab and delete its file (under the lock: no block is in it, so no read
        or write of it is in flight)."""
        if self._slabs.get(slab.slot_bytes) is slab:
            del self._slabs[slab.slot_bytes]
        self._unflushed.discard(slab)
        self._written.discard(slab)
        slab.remove_files()
        slab.close()

    def record(self, key: bytes) -> BlockRecord:
        """The block's record: the one it was written with, or a recovered block's, made now."""
        record = self._blocks.get(key)
        if record is not None:
            return record
        rows, row = self._recovered_row(key)
        return rows.record(row)

    def checksum(self, key: bytes) -> int:
        """The xxh3_64 of the block's payload, as its header holds it (its slab keeps it: a
        recovered record's ``checksum`` is 0)."""
        with self._lock:
            _, slab, slot = self._where(key)
            return slab.checksum(slot)

    def records(self) -> list[BlockRecord]:
        """The record of every block this tier holds (a snapshot; for inspection)."""
        with self._lock:
            return [*self._blocks.values(), *(r for rows in self._recovered for r in rows.records())]

    def recover_blocks(self) -> Iterator[RecoveredBlocks]:
        """Rebuild the index from the slabs' record files (``slab_recovery``): erase damaged
        records' slots, yield each slab's intact blocks, and hold them as its rows
        (``RecoveredRows``). A slab found without its record file has its slots' headers read
        instead, and the record file written again from them."""
        finder = SlabFinder(self.path, self.o_direct, self.verify_on_recover, self._staging)
        shared: dict = {}   # one object per key and size (a child's parent_key is its parent's key)
        try:
            for slab, rebuild in finder.slabs(self._slabs.__contains__):
                self._slabs[slab.slot_bytes] = slab
                taken = self._holds if self._recovered else self._blocks.__contains__   # (the same: quicker)
                found, slots, count = finder.intact(slab, rebuild, self.capacity_bytes - self.used_bytes,
                                                    taken, shared)
                with self._lock:
                    if found:
                        self._recovered += (RecoveredRows(slab, found, slots),)
                    self.used_bytes += len(found) * slab.slot_bytes
                    slab.adopt(slots, count)
                    if not found:
                        self._retire(slab)
                self._count_recovery(finder)
                if found:
                    yield found
        finally:
            self._count_recovery(finder)

    def _count_recovery(self, finder: SlabFinder) -> None:
        self.corrupt_dropped += finder.take_dropped()
        self.recovery_skipped_not_regular += finder.take_skipped()

    def close(self) -> None:
        self.finish_drops()
        with self._lock:
            for slab in self._slabs.values():
                slab.close()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "blocks": len(self._blocks) + sum(map(len, self._recovered)),
                "o_direct": int(self.o_direct),
                "slab_files": sum(1 for s in self._slabs.values() if s.fd >= 0),
                "recovery_skipped_not_regular": self.recovery_skipped_not_regular,
                "file_fsyncs": self.file_fsyncs, "filesystem_flushes": self.filesystem_flushes}


def _lands_in_place(dst: np.ndarray, n: int) -> bool:
    """Whether an O_DIRECT read of an ``n``-byte payload can fill ``dst`` itself: a whole number
    of pages, at a page boundary, with room for it."""
    return n == _round_up(n) and dst.nbytes >= n and _page_aligned(dst)


def _page_aligned(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.ctypes.data % ALIGN == 0


class _ShortWrite(Exception):
    """A ``pwritev`` that failed with ``written`` bytes landed before ``error``."""

    def __init__(self, written: int, error: OSError) -> None:
        super().__init__(written, error)
        self.written, self.error = written, error


def _pwritev_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written (a short write happens on a nearly full disk); a
    failure raises ``_ShortWrite`` saying how far it got."""
    total, done = sum(p.nbytes for p in pieces), 0
    try:
        done = os.pwritev(fd, pieces, offset)
        while done < total:
            skip, rest = done, []
            for p in pieces:
                if skip >= p.nbytes:
                    skip -= p.nbytes
                    continue
                rest.append(p[skip:])
                skip = 0
            n = os.pwritev(fd, rest, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
    except OSError as e:
        raise _ShortWrite(done, e) from e


def _whole_blocks(records: list[BlockRecord], written: int) -> int:
    """How many of a run's leading blocks (header and padded payload each) lie whole in its
    first ``written`` bytes."""
    whole = 0
    for record in records:
        written -= HEADER_BYTES + _round_up(record.stored_size)
        if written < 0:
            break
        whole += 1
    return whole

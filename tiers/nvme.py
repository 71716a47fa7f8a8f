"""NVMe tier: one checksummed file per block in a local directory, found again after a restart.

File = a 4 KiB header (record + xxh3 of the payload + xxh3 of the header) followed by the payload
padded to 4 KiB, so the whole file moves with O_DIRECT from one aligned staging buffer (falling
back to buffered I/O where the filesystem refuses O_DIRECT, e.g. tmpfs).

Atomic and durable: a block is written to ``<name>.tmp``, fsynced, renamed, and the directory is
fsynced once per batch (``write_unsynced`` + ``sync``; ``write`` does both). Demotions (never
acknowledged as persisted) skip the payload's fsync too: the next ``sync()`` flushes them all with
one ``syncfs`` (group commit), and a crash before then may tear one, which its checksum catches. A crash leaves either no file, a ``.tmp`` (deleted at recovery) or a
complete file. Every read verifies the payload checksum; a bad or torn file is deleted, counted
and reported as ``BlockCorrupt`` (the store turns that into a miss). Warm restart: ``recover()``
rebuilds the index from the headers, so a restarted daemon serves what it had.

Planted files (see ``private_files``): the directory is created 0700 and an existing one must be
ours and private (an empty loose one is tightened to 0700, a loose one with entries is refused);
block, temp and probe files are created 0600 with ``O_EXCL|O_NOFOLLOW``, so a symlink planted
under one of their names is replaced, never written through; recovery never follows a symlink or
waits on a FIFO named ``*.kvb``: it skips it, leaves it there and counts it
(``recovery_skipped_not_regular``); a read finding one under a stored block's name drops the
block as corrupt (a counted miss).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterator

import numpy as np
import xxhash

from kvstore.errors import BlockCorrupt, BlockTooLarge, TierFull, TierIOError
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch, as_bytes
from kvstore.tiers.private_files import (NotRegularFile, claim_private_dir, create_exclusive, fsync_dir,
                                         open_regular, replace_file, syncfs, unlink_quietly)

log = logging.getLogger("kvstore.tiers.nvme")

ALIGN = 4096
HEADER_BYTES = 4096
MAGIC = b"KVSBLK01"
_HEADER = struct.Struct("<8s16sB64sB64sHQQQ")  # magic ns hash_len hash parent_len parent codec raw stored sum
_HEADER_SUM = struct.Struct("<Q")
SUFFIX = ".kvb"


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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
        self._files: dict[bytes, tuple[BlockRecord, int]] = {}  # key -> (record, footprint)
        self._lock = threading.Lock()
        self._unflushed = 0   # payloads written without their fsync since the last sync()
        self.file_fsyncs = 0          # payloads fsynced one by one (``write``)
        self.filesystem_flushes = 0   # ``sync()``s that flushed payloads written without one (group commits)
        # one page-aligned, touched staging buffer per thread (O_DIRECT needs alignment); an
        # oversized block's is freed after use rather than kept by every thread that wrote one
        self._staging = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)

    # -- helpers ---------------------------------------------------------------------------------

    def file_path(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    # -- contract --------------------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        fp = HEADER_BYTES + _round_up(nbytes)
        if fp > self.capacity_bytes:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the nvme tier ({self.capacity_bytes} bytes)")
        return fp

    def allocate(self, record: BlockRecord) -> None:
        fp = self.footprint(record.stored_size)
        with self._lock:
            if record.key in self._files:
                raise KeyError(f"{record.key.hex()} already in nvme tier")
            if fp > self.free_bytes:
                raise TierFull(f"nvme tier has {self.free_bytes} free bytes, needs {fp}")
            self._files[record.key] = (record, fp)
            self.used_bytes += fp

    def write(self, record: BlockRecord, data) -> None:
        self.write_unsynced(record, data)
        self.sync()

    def write_unsynced(self, record: BlockRecord, data, durable: bool = True) -> None:
        """Write, fsync and rename one reserved block; its directory entry waits for ``sync()``.
        ``durable=False``: no fsync of the payload either; ``sync()`` flushes it later."""
        try:
            self._write_file(record, data, fsync=durable)
            with self._lock:   # writers run on several threads (a put's disk writes in flight)
                if durable:
                    self.file_fsyncs += 1
                else:
                    self._unflushed += 1
        except OSError as e:
            self.drop(record.key)
            cause = "disk full" if e.errno == errno.ENOSPC else e.strerror
            raise TierIOError(f"nvme tier: writing to {self.path} failed: {cause}") from e

    def sync(self) -> None:
        """Make every write so far durable: one filesystem flush if any payload was written
        without its fsync (``durable=False``), then one directory fsync, for a whole batch."""
        with self._lock:
            unflushed, self._unflushed = self._unflushed, 0
        try:
            if unflushed:
                syncfs(self.path)
                with self._lock:
                    self.filesystem_flushes += 1
            fsync_dir(self.path)
        except OSError as e:
            raise TierIOError(f"nvme tier: fsync of directory {self.path} failed: {e.strerror}") from e

    def _write_file(self, record: BlockRecord, data, fsync: bool = True) -> None:
        """Header + payload in one pwritev. A page-aligned payload (CPU-arena slots, pooled server
        buffers) goes to disk straight from where it is; anything else is copied once into the
        thread's aligned staging buffer, which O_DIRECT needs."""
        src = as_bytes(data)[:record.stored_size]
        n = record.stored_size
        padded = _round_up(n)
        if not record.checksum:
            record.checksum = xxhash.xxh3_64_intdigest(src)
        direct = padded == n and _page_aligned(src)
        stage = self._staging.get(HEADER_BYTES + (0 if direct else padded))
        arr = np.frombuffer(stage, dtype=np.uint8, count=HEADER_BYTES + (0 if direct else padded))
        header = encode_header(record)
        arr[:HEADER_BYTES] = 0
        arr[:len(header)] = np.frombuffer(header, dtype=np.uint8)
        if direct:
            pieces = [memoryview(stage)[:HEADER_BYTES], memoryview(src)]
        else:
            np.copyto(arr[HEADER_BYTES:HEADER_BYTES + n], src)
            arr[HEADER_BYTES + n:] = 0
            pieces = [memoryview(stage)[:HEADER_BYTES + padded]]
        replace_file(self.file_path(record.key), lambda fd: _pwritev_all(fd, pieces),
                     os.O_DIRECT if self.o_direct else 0, fsync=fsync)

    def read_into(self, key: bytes, out) -> int:
        """Verified read. A page-aligned ``out`` with room for the padded payload is filled by the
        disk directly (no staging copy); if verification then fails its contents are undefined
        and ``BlockCorrupt`` says so: the caller treats it as a miss."""
        record, _ = self._files[key]
        n = record.stored_size
        padded = _round_up(n)
        dst = as_bytes(out)
        direct = padded == n and dst.nbytes >= n and _page_aligned(dst)
        stage = self._staging.get(HEADER_BYTES + (0 if direct else padded))
        path = self.file_path(key)
        try:   # a directory, FIFO or symlink planted under the block's name is a miss, never a hang
            fd = open_regular(path, os.O_DIRECT if self.o_direct else 0)
        except FileNotFoundError:
            self._corrupt(key, "file vanished")
        except NotRegularFile as e:
            self._corrupt(key, f"replaced by a {e.kind}")
        try:
            if direct:
                got = os.preadv(fd, [memoryview(stage)[:HEADER_BYTES], memoryview(dst[:n])], 0)
                payload = dst[:n]
            else:
                got = os.preadv(fd, [memoryview(stage)[:HEADER_BYTES + padded]], 0)
                payload = np.frombuffer(stage, dtype=np.uint8, count=n, offset=HEADER_BYTES)
        finally:
            os.close(fd)
        if got < HEADER_BYTES + n:
            self._corrupt(key, f"truncated ({got} of {HEADER_BYTES + padded} bytes)")
        try:
            on_disk = decode_header(stage[:HEADER_BYTES])
        except ValueError as e:
            self._corrupt(key, str(e))
        if on_disk.key != key or xxhash.xxh3_64_intdigest(payload) != on_disk.checksum:
            self._corrupt(key, "payload checksum mismatch")
        if not direct:
            np.copyto(dst[:n], payload)
        return n

    def _corrupt(self, key: bytes, why: str):
        self.corrupt_dropped += 1
        self.drop(key)
        raise BlockCorrupt(f"nvme block {key.hex()[:24]}... dropped: {why}")

    def drop(self, key: bytes) -> None:
        with self._lock:
            entry = self._files.pop(key, None)
            if entry is None:
                return
            self.used_bytes -= entry[1]
        unlink_quietly(self.file_path(key))

    def record(self, key: bytes) -> BlockRecord:
        return self._files[key][0]

    def records(self) -> list[BlockRecord]:
        """The record of every block this tier holds (a snapshot; for inspection)."""
        with self._lock:
            return [record for record, _ in self._files.values()]

    def recover(self) -> Iterator[BlockRecord]:
        """Rebuild the index from disk: delete leftovers and damaged files, yield intact blocks."""
        try:
            names = os.listdir(self.path)
        except OSError as e:
            raise TierIOError(f"nvme tier: cannot list {self.path}: {e.strerror}") from e
        for name in names:
            path = os.path.join(self.path, name)
            if name.endswith(".tmp"):
                unlink_quietly(path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                record = self._check_file(path)
            except NotRegularFile as e:
                self.recovery_skipped_not_regular += 1
                log.warning("nvme tier: skipped %s at recovery: it is a %s, not a block file", path, e.kind)
                continue
            except (OSError, ValueError):
                self.corrupt_dropped += 1
                unlink_quietly(path)
                continue
            if record.key.hex() + SUFFIX != name:
                self.corrupt_dropped += 1
                unlink_quietly(path)
                continue
            fp = HEADER_BYTES + _round_up(record.stored_size)
            with self._lock:
                self._files[record.key] = (record, fp)
                self.used_bytes += fp
            yield record

    def _check_file(self, path: str) -> BlockRecord:
        """The header of one candidate; ``NotRegularFile`` (never opened, or never waited on) for a
        FIFO, symlink, socket, device or directory named like a block."""
        fd = open_regular(path)
        try:
            record = decode_header(os.pread(fd, HEADER_BYTES, 0))
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + _round_up(record.stored_size):
                raise ValueError("size does not match header (torn write)")
            if self.verify_on_recover:
                payload = os.pread(fd, record.stored_size, HEADER_BYTES)
                if xxhash.xxh3_64_intdigest(payload) != record.checksum:
                    raise ValueError("payload checksum mismatch")
        finally:
            os.close(fd)
        return record

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "blocks": len(self._files), "o_direct": int(self.o_direct),
                "recovery_skipped_not_regular": self.recovery_skipped_not_regular,
                "file_fsyncs": self.file_fsyncs, "filesystem_flushes": self.filesystem_flushes}


def _page_aligned(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.ctypes.data % ALIGN == 0


def _pwritev_all(fd: int, pieces: list[memoryview]) -> None:
    """pwritev until every byte is written (a short write happens on a nearly full disk)."""
    total = sum(p.nbytes for p in pieces)
    done = os.pwritev(fd, pieces, 0)
    while done < total:
        skip, rest = done, []
        for p in pieces:
            if skip >= p.nbytes:
                skip -= p.nbytes
                continue
            rest.append(p[skip:])
            skip = 0
        n = os.pwritev(fd, rest, done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n

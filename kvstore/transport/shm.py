"""Same-host zero-copy: map the daemon's CPU arena and copy blocks in and out with numpy.

Negotiation (``Handshake``): the client sends a random nonce; the daemon writes it to a probe
file next to the arena and answers with the arena's path, size, device and inode, and the probe
path. The client uses shm only if it can read its own nonce back from the probe file *and* the
arena file it opens has the announced device/inode — a remote client that happens to have a file
at the same path never passes both, so it never reads a stranger's memory.

Bytes then move by one copy per extent (``buffers.copy_each``: a memcpy) while the daemon holds a lease
(``PrepareLoad`` pins the blocks, ``PrepareStore`` reserves slots). Leases expire server-side, so
a client killed between prepare and complete leaks nothing.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import secrets
import time
from collections.abc import Sequence

import numpy as np

from kvstore.buffers import copy_each, copy_each_in, gather, scatter

PROBE_PREFIX = ".kvstore-probe-"


def write_probe(shm_dir: str, nonce: bytes) -> str:
    """Daemon side: leave ``nonce`` where only a process on this host can read it."""
    path = os.path.join(shm_dir, f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, nonce)
    finally:
        os.close(fd)
    return path


def reap_probes(shm_dir: str, older_than_s: float = 30.0) -> int:
    """Daemon side: delete probe files their clients never consumed."""
    n = 0
    cutoff = time.time() - older_than_s
    for path in glob.glob(os.path.join(shm_dir, f"{PROBE_PREFIX}{os.getpid()}-*")):
        with contextlib.suppress(FileNotFoundError):   # consumed meanwhile
            if os.stat(path).st_mtime < cutoff:
                os.unlink(path)
                n += 1
    return n


def nonce_is_local(probe_path: str, nonce: bytes) -> bool:
    """Client side: True only if the probe file holds exactly our nonce (then consume it)."""
    if not probe_path or not nonce:
        return False
    try:
        with open(probe_path, "rb") as f:
            ok = f.read(len(nonce) + 1) == nonce
    except OSError:
        return False
    if ok:
        with contextlib.suppress(OSError):
            os.unlink(probe_path)
    return ok


class MappedArena:
    """Copies in and out of a mapped arena, for ``ArenaMap`` and ``segments.SegmentMap``:
    ``memory`` is what extents slice (``[off:off + n]``)."""

    memory: object

    def ensure(self, extents) -> None:
        """Map what ``extents`` lie in (nothing to do where the whole arena is mapped)."""

    def copy_out(self, extents: Sequence[tuple[int, int]], dst: np.ndarray) -> int:
        """Copy a block's pieces into ``dst`` (flat uint8); returns bytes copied."""
        return gather(self.memory, extents, dst)

    def copy_in(self, extents: Sequence[tuple[int, int]], src: np.ndarray) -> int:
        return scatter(self.memory, extents, src)

    def copy_each_out(self, offsets: Sequence[int], lengths: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
        """Blocks of one extent each into their destinations (each exactly that long), in one loop."""
        copy_each(self.memory, offsets, lengths, dsts)

    def copy_each_in(self, offsets: Sequence[int], srcs: Sequence[np.ndarray], before_part=None,
                     threads: int | None = None) -> None:
        """Blocks into the start of their one extent each, in one loop (``buffers.copy_each_in``)."""
        copy_each_in(self.memory, offsets, srcs, before_part, threads)


class ArenaMap(MappedArena):
    """The daemon's CPU arena mapped into this process (read-write, shared pages), whole."""

    def __init__(self, path: str, nbytes: int, dev: int, ino: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < nbytes:
                raise OSError(f"{path} is not the daemon's arena (identity or size differs)")
            self._mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.arena = self.memory = np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        self.arena = self.memory = None
        with contextlib.suppress(BufferError):   # a caller still holds a view; the mapping goes with it
            self._mmap.close()

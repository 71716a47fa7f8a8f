"""What every peer driver (and bench_peers.py, which starts them) needs the same way: die with the
parent, caller buffers made like every other path's, a free loopback port. Imports nothing but
numpy: the drivers run in the peers' own venvs, where kvstore's dependencies may be missing."""

from __future__ import annotations

import ctypes
import mmap
import signal
import socket

import numpy as np

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, however it dies (a preexec_fn or a first call)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def touched(nbytes: int, random: bool) -> np.ndarray:
    """A caller buffer like every other path's in bench_peers.py: an anonymous mmap (4 KiB pages,
    as kvstore.ops.ceilings.touched_buffer and the memcpy ceiling use; numpy's own large arrays
    would get transparent huge pages, which copy about 1.4x faster here), every page touched."""
    arr = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    arr[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8) if random else 0
    return arr


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

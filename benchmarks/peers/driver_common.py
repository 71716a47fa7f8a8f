"""What every peer driver (and the benchmarks that start servers) needs the same way: die with the
parent, caller buffers made like every other path's, a free loopback port, waiting for a server to
listen and stopping it. Imports nothing but numpy: the drivers run in the peers' own venvs, where
kvstore's dependencies may be missing."""

from __future__ import annotations

import ctypes
import mmap
import signal
import socket
import subprocess
import time

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


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout_s`` for it to exit, then SIGKILL it; nothing when
    it has exited already."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def wait_port(port: int, proc: subprocess.Popen | None = None, what: str = "server", timeout_s: float = 30.0) -> None:
    """Return once something listens on 127.0.0.1:``port``; raise when ``proc`` (``what``) exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} in {timeout_s}s")

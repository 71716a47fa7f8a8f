"""What every reliability scenario shares: blocks whose bytes can be checked, and the daemon's vital signs.

Every payload is derived from its block hash (``payload``), so any byte a daemon serves can be
checked against the one correct value; the rest reads the daemon's log, memory and /dev/shm and
makes small tmpfs mounts for disk faults.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import numpy as np

from kvstore import ChainHasher, KVLayout
from kvstore.ops.local_daemon import LocalDaemon


KiB, MiB = 1 << 10, 1 << 20


class Unsupported(Exception):
    """The scenario cannot run here (e.g. mounting is not permitted); the reason says why."""


# -- blocks whose bytes can be checked -------------------------------------------------------------

def layout(block_bytes: int, model: str = "reliability/model") -> KVLayout:
    return KVLayout(model=model, num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
                    block_bytes=block_bytes)


def payload(h: bytes, nbytes: int) -> np.ndarray:
    """The one correct payload of block ``h``: anything else served under ``h`` is a wrong byte."""
    return np.frombuffer(np.random.Generator(np.random.PCG64(int.from_bytes(h[:16], "little"))).bytes(nbytes),
                         dtype=np.uint8)


def is_exact(h: bytes, got, nbytes: int) -> bool:
    return got is not None and len(got) == nbytes and bytes(got) == payload(h, nbytes).tobytes()


def hashes(n: int, seed: int = 0, algorithm: str = "xxh3_128") -> list[bytes]:
    return ChainHasher(algorithm, seed=seed).chain(np.arange(16 * n), 16)


def daemon_log_errors(d: LocalDaemon) -> int:
    """Unexpected exceptions the daemon logged (each is a bug: every failure should be a status)."""
    try:
        text = d.log()
    except OSError:
        return 0
    # gRPC's own "Exception deserializing request" (malformed protobuf, answered INTERNAL) is not ours
    return sum(text.count(s) for s in ("unexpected error in", "Exception calling application",
                                       "Exception iterating responses", "lease reaper tick failed"))


def rss(pid: int) -> dict:
    """The daemon's resident memory: anonymous (heap) and shared (the arena) separately."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssShmem", "RssFile")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * KiB
    return out


def kill_and_reap(d: LocalDaemon) -> None:
    d.kill()
    for seg in os.listdir("/dev/shm"):
        if seg.startswith((f"kvstore-{d.pid}-", f".kvstore-probe-{d.pid}-")):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", seg))


@contextlib.contextmanager
def tmpfs(size: str, ro: bool = False):
    """A fresh small tmpfs (root only); ``Unsupported`` where mounting is not permitted."""
    where = tempfile.mkdtemp(prefix="kvstore-rel-tmpfs-")
    opts = f"size={size}" + (",ro" if ro else "")
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", where], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        os.rmdir(where)
        raise Unsupported(f"cannot mount tmpfs: {e}") from None
    if p.returncode != 0:
        os.rmdir(where)
        raise Unsupported(f"cannot mount tmpfs ({p.stderr.strip() or 'mount failed'}); run as root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            os.rmdir(where)


def remount(where: str, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", where], check=True, capture_output=True, timeout=30)

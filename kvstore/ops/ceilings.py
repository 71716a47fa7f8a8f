"""Physical ceilings measured in the same run as a benchmark, so results are quoted as ratios.

The machines this project runs on are shared and noisy: an absolute GB/s figure means little,
a ratio against memcpy / raw O_DIRECT / raw sockets measured a second earlier means a lot.
Every function returns the median GB/s (1e9 bytes/s) of ``reps`` repetitions and uses pooled,
already-touched buffers, exactly what a well-written data path could hope to reach. Used by
``kvstore bench``, ``kvstore plan`` (tier bandwidths) and the scripts in benchmarks/.

    from kvstore.ops.ceilings import memcpy_gbps, odirect_read_gbps, tcp_loopback_gbps
    python -m kvstore.ops.ceilings [DIR]          # print this machine's ceilings as JSON

Functions: memcpy_gbps(nbytes), odirect_write_gbps(dir, nbytes), odirect_read_gbps(dir, nbytes),
tcp_loopback_gbps(nbytes), unix_socket_gbps(nbytes), median_of(fn, reps). On a noisy machine,
interleave instead: MemcpyPass / ODirectWritePass / ODirectReadPass / TcpPass are callables timing
one pass each, to alternate with the code under test and take per-round ratios. The machine the
figures come from: kvstore.ops.machine.machine_facts.
"""

from __future__ import annotations

import mmap
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.ops.machine import machine_facts
from kvstore.tiers.nvme import o_direct_supported  # the tier's own probe

ALIGN = 4096
GB = 1e9


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def touched_buffer(nbytes: int, fill: int | None = None) -> mmap.mmap:
    """A page-aligned anonymous buffer with every page already faulted in (O_DIRECT-ready)."""
    buf = mmap.mmap(-1, max(_round_up(nbytes), ALIGN))
    arr = np.frombuffer(buf, dtype=np.uint8)
    if fill is None:
        arr[:] = np.random.default_rng(0).integers(0, 256, size=len(arr), dtype=np.uint8)
    else:
        arr[:] = fill
    del arr
    return buf


def median_of(fn: Callable[[], float], reps: int) -> float:
    """Median of ``reps`` calls of ``fn`` (each returns seconds); returns seconds."""
    return statistics.median(fn() for _ in range(reps))


def _iters_for(nbytes: int, target_bytes: int = 256 << 20) -> int:
    return max(1, target_bytes // max(nbytes, 1))


class MemcpyPass:
    """One timed pass of ``count`` copies of ``nbytes`` (numpy copyto, one core).

    Without ``working_set`` the same two buffers are copied over and over, so blocks that fit the
    CPU caches are measured at cache speed ("hot"). With ``working_set`` each copy goes to the next
    ``nbytes`` of a ``working_set``-byte destination (from a pool of 8 sources): the memory traffic
    of a store filling its arena, the fair ceiling for a tier of that size. ``cold_sources``: the
    sources too span ``working_set`` bytes (a buffer of their own), so neither side of a copy is in
    the caches: the ceiling for reading blocks out of an arena larger than the caches. Calling the
    object runs one pass and returns its seconds, so a benchmark can interleave it with the code it
    judges."""

    def __init__(self, nbytes: int, count: int | None = None, working_set: int | None = None,
                 cold_sources: bool = False, threads: int = 1) -> None:
        if working_set is None:
            self.srcs = [np.frombuffer(touched_buffer(nbytes), dtype=np.uint8)[:nbytes]]
            slots = 1
        else:
            slots = max(1, working_set // nbytes)
            if cold_sources:
                src = np.frombuffer(touched_buffer(slots * nbytes, fill=1), dtype=np.uint8)
                self.srcs = [src[i * nbytes:(i + 1) * nbytes] for i in range(slots)]
            else:
                self.srcs = [np.frombuffer(touched_buffer(nbytes, fill=i), dtype=np.uint8)[:nbytes] for i in range(8)]
        dst = np.frombuffer(touched_buffer(slots * nbytes, fill=0), dtype=np.uint8)
        self.dsts = [dst[i * nbytes:(i + 1) * nbytes] for i in range(slots)]
        self.count = count or max(_iters_for(nbytes), slots)
        self.bytes = nbytes * self.count
        self.threads = threads   # > 1: the copies split in that many runs, each on a thread of its own
        # the other runs' threads, started now so that no pass times their start
        self._pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
        if self._pool is not None:
            for f in [self._pool.submit(time.sleep, 0.01) for _ in range(threads - 1)]:
                f.result()

    def _run(self, start: int, stop: int) -> None:
        srcs, dsts = self.srcs, self.dsts
        for i in range(start, stop):
            np.copyto(dsts[i % len(dsts)], srcs[i % len(srcs)])

    def __call__(self) -> float:
        if self.threads < 2:
            t = time.perf_counter()
            self._run(0, self.count)
            return time.perf_counter() - t
        cuts = [self.count * k // self.threads for k in range(self.threads + 1)]
        t = time.perf_counter()
        others = [self._pool.submit(self._run, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
        self._run(cuts[0], cuts[1])
        for f in others:
            f.result()
        return time.perf_counter() - t


def memcpy_gbps(nbytes: int, reps: int = 5, working_set: int | None = None) -> float:
    """Median GB/s of ``MemcpyPass`` (see there for ``working_set``)."""
    once = MemcpyPass(nbytes, working_set=working_set)
    once()
    return once.bytes / median_of(once, reps) / GB


def _odirect_flags() -> int:
    return getattr(os, "O_DIRECT", 0)


class _FilesPass:
    def __init__(self, directory: str, nbytes: int, files: int | None, prefix: str) -> None:
        self.flag = _odirect_flags() if o_direct_supported(directory) else 0
        self.size = _round_up(nbytes)
        self.buf = touched_buffer(self.size)
        self.count = files or max(2, min(16, _iters_for(nbytes, 128 << 20)))
        self.bytes = self.size * self.count
        self.work = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self.paths = [os.path.join(self.work, f"{i}.bin") for i in range(self.count)]

    def close(self) -> None:
        for p in self.paths:
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(self.work)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ODirectWritePass(_FilesPass):
    """One timed pass writing ``files`` new files of ``nbytes`` each with O_DIRECT + fsync per
    file (buffered where O_DIRECT is refused), the way a durable block store must; with
    ``fsync=False`` without the fsyncs (what a write-back cache's demotions need, and what
    LMCache's local disk backend does)."""

    def __init__(self, directory: str, nbytes: int, files: int | None = None, fsync: bool = True) -> None:
        super().__init__(directory, nbytes, files, "ceiling-w-")
        self.fsync = fsync

    def __call__(self) -> float:
        t = time.perf_counter()
        for p in self.paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flag, 0o600)
            try:
                os.write(fd, self.buf)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        return time.perf_counter() - t


class ODirectReadPass(_FilesPass):
    """One timed pass reading ``files`` files of ``nbytes`` each with O_DIRECT, preadv into one
    pooled aligned buffer (buffered where O_DIRECT is refused)."""

    def __init__(self, directory: str, nbytes: int, files: int | None = None) -> None:
        super().__init__(directory, nbytes, files, "ceiling-r-")
        for p in self.paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, self.buf)
            os.fsync(fd)
            os.close(fd)

    def __call__(self) -> float:
        t = time.perf_counter()
        for p in self.paths:
            fd = os.open(p, os.O_RDONLY | self.flag)
            try:
                got = os.preadv(fd, [self.buf], 0)
            finally:
                os.close(fd)
            if got != self.size:
                raise OSError(f"short read of {p}: {got}")
        return time.perf_counter() - t


def odirect_write_gbps(directory: str, nbytes: int, reps: int = 5, files: int | None = None) -> float:
    """Median GB/s of ``ODirectWritePass``; its files are removed afterwards."""
    with ODirectWritePass(directory, nbytes, files) as once:
        once()
        return once.bytes / median_of(once, reps) / GB


def odirect_read_gbps(directory: str, nbytes: int, reps: int = 5, files: int | None = None) -> float:
    """Median GB/s of ``ODirectReadPass``; its files are removed afterwards."""
    with ODirectReadPass(directory, nbytes, files) as once:
        once()
        return once.bytes / median_of(once, reps) / GB


class TcpPass:
    """``count`` messages of ``nbytes`` over one TCP loopback connection, sent from and received
    into distinct, already-touched buffers (``count * nbytes`` each side, like a get that reads
    distinct blocks into distinct outputs): what a perfect remote data path could do on this
    machine at this moment. One pass = one call."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count, self.bytes = nbytes, count, nbytes * count
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._go = threading.Semaphore(0)
        self._stop = False
        src = memoryview(np.ones(nbytes * count, dtype=np.uint8)).cast("B")
        payloads = [src[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        port = self._srv.getsockname()[1]

        def sender() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    self._go.acquire()
                    if self._stop:
                        return
                    for payload in payloads:
                        c.sendall(payload)

        self._thread = threading.Thread(target=sender, daemon=True)
        self._thread.start()
        self._conn, _ = self._srv.accept()
        sink = memoryview(np.zeros(nbytes * count, dtype=np.uint8)).cast("B")
        self._sinks = [sink[i * nbytes:(i + 1) * nbytes] for i in range(count)]

    def __call__(self) -> float:
        self._go.release()
        t = time.perf_counter()
        for dst in self._sinks:
            got = 0
            while got < self.nbytes:
                k = self._conn.recv_into(dst[got:], self.nbytes - got)
                if k == 0:
                    raise ConnectionError("ceiling sender closed")
                got += k
        return time.perf_counter() - t

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join(10)
        self._conn.close()
        self._srv.close()


def _socket_pair_gbps(server: socket.socket, connect: Callable[[], socket.socket], nbytes: int,
                      reps: int) -> float:
    """Send ``nbytes`` from a client thread to the accepting side, recv_into a pooled buffer."""
    iters = max(2, _iters_for(nbytes, 128 << 20))
    payload = memoryview(touched_buffer(nbytes))[:nbytes]
    sink = memoryview(touched_buffer(nbytes, fill=0))[:nbytes]
    total_rounds = reps + 1

    def sender() -> None:
        c = connect()
        try:
            for _ in range(total_rounds * iters):
                c.sendall(payload)
            c.recv(1)
        finally:
            c.close()

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    conn, _ = server.accept()
    times = []
    try:
        for r in range(total_rounds):
            t = time.perf_counter()
            for _ in range(iters):
                got = 0
                while got < nbytes:
                    k = conn.recv_into(sink[got:], nbytes - got)
                    if k == 0:
                        raise ConnectionError("sender closed early")
                    got += k
            if r:
                times.append(time.perf_counter() - t)
        conn.sendall(b"x")
    finally:
        conn.close()
        th.join(10)
    return nbytes * iters / statistics.median(times) / GB


def tcp_loopback_gbps(nbytes: int, reps: int = 5) -> float:
    """Raw TCP over 127.0.0.1, one stream, recv_into a pre-allocated buffer."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def connect() -> socket.socket:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return c

    try:
        return _socket_pair_gbps(srv, connect, nbytes, reps)
    finally:
        srv.close()


def unix_socket_gbps(nbytes: int, reps: int = 5) -> float:
    """A Unix stream socket, recv_into a pre-allocated buffer."""
    d = tempfile.mkdtemp(prefix="ceiling-uds-")
    path = os.path.join(d, "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def connect() -> socket.socket:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        return c

    try:
        return _socket_pair_gbps(srv, connect, nbytes, reps)
    finally:
        srv.close()
        os.unlink(path)
        os.rmdir(d)


def main(argv: list[str] | None = None) -> int:
    """Print this machine's ceilings for 16 MiB transfers (O_DIRECT in DIR) as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvstore.ops.ceilings", description=main.__doc__)
    ap.add_argument("dir", nargs="?", default=tempfile.gettempdir(), help="directory for the O_DIRECT passes")
    d = ap.parse_args(argv).dir
    mib = 16 << 20
    print(json.dumps({
        "machine": machine_facts(d),
        "memcpy_16MiB": memcpy_gbps(mib),
        "odirect_write_16MiB": odirect_write_gbps(d, mib),
        "odirect_read_16MiB": odirect_read_gbps(d, mib),
        "tcp_16MiB": tcp_loopback_gbps(mib),
        "unix_16MiB": unix_socket_gbps(mib),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A private ``kvstore serve`` child process on an ephemeral loopback port.

``kvstore bench`` (without ``--url``), the benchmarks and the tests all need a real daemon of
their own for a while; this is the one way to start one:

    d = start_local_daemon(workdir, "--lease-seconds", "1")   # extra `kvstore serve` flags
    with d.client() as c: ...                                  # a kvstore.client.Client for it
    d.stop()                                                   # SIGTERM, waits, returns the exit code

The child runs ``python -P -m kvstore.ops.cli serve`` with its working directory set to
``workdir``: neither the caller's cwd nor a source checkout there can shadow the installed
package (a checkout's ``kvstore/`` lacks ``kvstore.proto``, ``kvstore.tiers`` and
``kvstore.connectors``, which the install maps in from top-level folders). KVSTORE_* variables of
the calling environment are not passed on, so the daemon sees only its flags. It reports its
address through ``--ready-file``; ``start_local_daemon`` returns once the standard gRPC health
check answers SERVING.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


class LocalDaemon:
    """A running ``kvstore serve`` child: its address, ports, log, and how to stop it."""

    def __init__(self, proc: subprocess.Popen, info: dict, nvme_path: str | None, log_path: str,
                 client_kwargs: dict | None = None) -> None:
        self.proc = proc
        self.client_kwargs = dict(client_kwargs or {})
        self.info = info
        self.address: str = info["address"]
        self.port: int = info["port"]
        self.metrics_port: int | None = info.get("metrics_port")
        self.pid: int = info["pid"]
        self.arena_path: str | None = info.get("arena_path")
        self.nvme_path = nvme_path
        self.log_path = log_path

    @property
    def url(self) -> str:
        return self.address

    def client(self, **kwargs):
        from kvstore.client import Client

        return Client(self.address, **{**self.client_kwargs, **kwargs})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` (SIGTERM: graceful) and wait; returns the exit code (kills after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, and return once the daemon's sockets are released (``kill_until_released``)."""
        if self.proc.poll() is None:
            kill_until_released(self.pid)
        self.stop(signal.SIGKILL)


def kill_until_released(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL ``pid`` and return once its sockets are released, so what runs next meets a dead
    daemon rather than a dying one: a killed process drops its descriptors first and the kernel
    frees its sockets a moment later (a worker's tick), and until then a peer can still send to
    them (Linux: reads /proc)."""
    sockets = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                sockets.add(link[8:-1])
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):   # gone already
        return
    deadline = time.monotonic() + timeout_s
    while sockets & _socket_inodes() and time.monotonic() < deadline:
        time.sleep(0.01)


def _socket_inodes() -> set[str]:
    """Inodes of this network namespace's Unix and TCP sockets."""
    live: set[str] = set()
    for table, column in (("unix", 6), ("tcp", 9), ("tcp6", 9)):
        try:
            with open(f"/proc/net/{table}") as f:
                next(f)
                live |= {line.split()[column] for line in f}
        except FileNotFoundError:   # no IPv6
            continue
    return live


def serve_command(*args: str) -> list[str]:
    """``kvstore serve ARGS`` for this interpreter, immune to the cwd (``-P``: no cwd on sys.path)."""
    return [sys.executable, "-P", "-m", "kvstore.ops.cli", "serve", *args]


def start_local_daemon(workdir, *flags: str, cpu_bytes: str = "64MiB", nvme_bytes: str = "256MiB",
                       nvme_path: str | None = None, env: dict | None = None, timeout: float = 90.0,
                       client_kwargs: dict | None = None, cpus: list[int] | None = None) -> LocalDaemon:
    """Start ``kvstore serve`` with ``flags`` in ``workdir`` (created; holds the ready file, the log
    and, unless ``nvme_path`` is given, the NVMe directory) and wait until it is healthy.

    ``env`` is added to the child's environment; ``client_kwargs`` are the defaults of
    ``LocalDaemon.client()`` (and of the health probe), e.g. ``{"root_ca": cert_path}`` for a TLS
    daemon or ``{"token": ...}``; ``cpus``: the cores the daemon (every thread and process it
    starts) may run on, set in the child before it runs (None: this process's)."""
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    nvme_path = nvme_path or os.path.join(workdir, "nvme")
    ready = os.path.join(workdir, f"ready-{time.monotonic_ns()}.json")
    log_path = ready.replace(".json", ".log")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env.update(env or {})
    cmd = serve_command("--listen", "127.0.0.1:0", "--ready-file", ready, "--cpu-bytes", cpu_bytes,
                        "--nvme-bytes", nvme_bytes, "--nvme-path", nvme_path, *flags)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=workdir,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"kvstore serve exited with {proc.returncode}:\n{_read(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"kvstore serve did not become ready in {timeout}s:\n{_read(log_path)}")
        time.sleep(0.05)
    with open(ready) as f:
        daemon = LocalDaemon(proc, json.load(f), nvme_path, log_path, client_kwargs)
    _wait_serving(daemon, deadline)
    return daemon


def _wait_serving(daemon: LocalDaemon, deadline: float) -> None:
    c = daemon.client(timeout_s=2.0)
    try:
        while not c.health():
            if time.monotonic() > deadline or not daemon.alive():
                daemon.kill()
                raise TimeoutError(f"kvstore serve never reported SERVING:\n{daemon.log()}")
            time.sleep(0.05)
    finally:
        c.close()


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()

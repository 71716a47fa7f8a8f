"""Start a REAL kvstore daemon subprocess for tests (and for other helpers' tests to reuse).

    from tests.daemon_util import start_daemon          # or: from daemon_util import start_daemon
    d = start_daemon(tmp_path, "--lease-seconds", "1")  # extra `kvstore serve` flags
    c = d.client()                                      # a kvstore.client.Client for it
    ...
    d.stop()                                            # SIGTERM, waits, returns the exit code

The daemon listens on an ephemeral loopback port (``--listen 127.0.0.1:0``) and reports its
address through ``--ready-file``; ``start_daemon`` returns once the standard gRPC health check
answers SERVING. Defaults are small (64 MiB CPU arena, 256 MiB NVMe tier under ``tmp_path``).
KVSTORE_* variables of the calling environment are not passed on, so tests see only their flags.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DaemonProcess:
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
        self.stop(signal.SIGKILL)


def start_daemon(tmp_path, *flags: str, cpu_bytes: str = "64MiB", nvme_bytes: str = "256MiB",
                 nvme_path: str | None = None, env: dict | None = None, timeout: float = 90.0,
                 client_kwargs: dict | None = None) -> DaemonProcess:
    """Start ``kvstore serve`` with ``flags`` and wait until it is healthy.

    ``client_kwargs`` are the defaults of ``DaemonProcess.client()`` (and of the health probe),
    e.g. ``{"root_ca": cert_path}`` for a TLS daemon or ``{"token": ...}``."""
    tmp = str(tmp_path)
    os.makedirs(tmp, exist_ok=True)
    nvme_path = nvme_path or os.path.join(tmp, "nvme")
    ready = os.path.join(tmp, f"ready-{time.monotonic_ns()}.json")
    log_path = ready.replace(".json", ".log")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env["PYTHONPATH"] = REPO + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env.update(env or {})
    cmd = [sys.executable, "-m", "kvstore.ops.cli", "serve", "--listen", "127.0.0.1:0", "--ready-file", ready,
           "--cpu-bytes", cpu_bytes, "--nvme-bytes", nvme_bytes, "--nvme-path", nvme_path, *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=tmp)
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"kvstore serve exited with {proc.returncode}:\n{open(log_path).read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"kvstore serve did not become ready in {timeout}s:\n{open(log_path).read()}")
        time.sleep(0.05)
    with open(ready) as f:
        d = DaemonProcess(proc, json.load(f), nvme_path, log_path, client_kwargs)
    c = d.client(timeout_s=2.0)
    try:
        while not c.health():
            if time.monotonic() > deadline or not d.alive():
                d.kill()
                raise TimeoutError(f"kvstore serve never reported SERVING:\n{d.log()}")
            time.sleep(0.05)
    finally:
        c.close()
    return d

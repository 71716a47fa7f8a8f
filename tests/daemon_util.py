"""Start a REAL kvstore daemon subprocess for tests: kvstore.ops.local_daemon under the test names.

    from daemon_util import start_daemon                 # tests/ is on sys.path (conftest.py)
    d = start_daemon(tmp_path, "--lease-seconds", "1")  # extra `kvstore serve` flags
    c = d.client()                                      # a kvstore.client.Client for it
    ...
    d.stop()                                            # SIGTERM, waits, returns the exit code

Defaults are small (64 MiB CPU arena, 256 MiB NVMe tier under ``tmp_path``); the daemon runs the
same kvstore the tests import (``python -P``, cwd ``tmp_path``), never a shadowing checkout.
"""

from __future__ import annotations

import time

from kvstore.ops.local_daemon import LocalDaemon as DaemonProcess
from kvstore.ops.local_daemon import start_local_daemon as start_daemon

__all__ = ["DaemonProcess", "start_daemon", "wait_codecs_warm"]


def wait_codecs_warm(d: DaemonProcess, timeout_s: float = 180.0) -> None:
    """Wait until the daemon's background codec warm-up (importing torch, compiling its kernels:
    over 100 MiB and, on an empty numba cache, tens of seconds) has ended: memory measured before
    then would count the warm-up, not what a test does."""
    deadline = time.monotonic() + timeout_s
    while not any(line in d.log() for line in ("codec kernels ready", "codec warm-up failed")):
        assert time.monotonic() < deadline, f"no end of the codec warm-up in {timeout_s}s:\n{d.log()[-2000:]}"
        time.sleep(0.1)

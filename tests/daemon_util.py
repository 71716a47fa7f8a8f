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


#: what a daemon logs as a codec warm-up starts (with tier codecs at start, else at the first lossy
#: codec call) and as it ends
WARM_UP_STARTS = ("codec kernels: compiling in child process", "codec kernels: no child process")
WARM_UP_ENDS = ("codec kernels ready", "codec warm-up failed", "compiling the codec kernels failed")


def wait_codecs_warm(d: DaemonProcess, timeout_s: float = 180.0) -> None:
    """Wait until no codec warm-up of the daemon's is under way (importing torch, compiling its
    kernels in a child process and loading them: over 350 MiB and, on an empty numba cache, tens
    of seconds): memory measured before then would count the warm-up, not what a test does. A
    daemon without tier codecs starts one only at its first lossy codec call (and logs then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = d.log()
        if max(log.rfind(line) for line in WARM_UP_ENDS) >= max(log.rfind(line) for line in WARM_UP_STARTS):
            return
        assert time.monotonic() < deadline, f"no end of the codec warm-up in {timeout_s}s:\n{log[-2000:]}"
        time.sleep(0.1)

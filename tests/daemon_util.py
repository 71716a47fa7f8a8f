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

from kvstore.ops.local_daemon import LocalDaemon as DaemonProcess
from kvstore.ops.local_daemon import start_local_daemon as start_daemon

__all__ = ["DaemonProcess", "start_daemon"]

"""Files a process names after itself in a shared directory (the CPU arena, the socket services'
sockets, the same-host probes in ``shm_dir``), removed once that process has exited: a daemon
killed with -9 or by the OOM killer closes nothing, and files in ``/dev/shm`` hold RAM until
someone unlinks them. A leaf: the tiers, the transports and the daemon each sweep their own.
"""

from __future__ import annotations

import os
import re


def owner_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (one of another user's that runs counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def sweep(directory: str, name: re.Pattern) -> int:
    """Unlink each file of ``directory`` whose name ``name`` matches, its group 1 a process id,
    when that process has exited (never this one's); how many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for entry in names:
        m = name.match(entry)
        if m is None or int(m.group(1)) == os.getpid() or not owner_gone(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, entry))
            removed += 1
        except OSError:
            pass
    return removed

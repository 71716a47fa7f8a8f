"""Real small filesystems for tests (root only): a tiny tmpfs to fill up, a ramfs that refuses O_DIRECT.

Tests that need one skip cleanly where mounting is impossible (not root, no CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import pytest


@contextlib.contextmanager
def mounted(fstype: str, options: str = ""):
    """Mount a fresh ``fstype`` on a temporary directory; skip the test if that is not allowed."""
    where = tempfile.mkdtemp(prefix=f"kvstore-{fstype}-")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, where]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        os.rmdir(where)
        pytest.skip(f"cannot mount {fstype}: {e}")
    if p.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount {fstype}: {p.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
        os.rmdir(where)

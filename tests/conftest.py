"""Shared fixtures. ``daemon_factory`` starts real daemon subprocesses (tests/daemon_util.py, i.e.
kvstore.ops.local_daemon) and stops every one it started at teardown; ``kv_daemon`` is one shared
default daemon per module; ``two_tenant_daemon`` one with tokens for tenants alice and bob and
its shm_dir (sockets, arena) in the test's own directory. tests/ and tests/engines/ go on sys.path so test modules import their
helpers (daemon_util, redis_util, venvs, vllm_runner) by plain name."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))

from daemon_util import DaemonProcess, start_daemon  # noqa: E402
from redis_util import prefix, redis_url  # noqa: E402,F401 - shared fixtures


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProcess] = []

    def start(*flags: str, **kwargs) -> DaemonProcess:
        sub = tmp_path / f"daemon{len(started)}"
        d = start_daemon(kwargs.pop("tmp", sub), *flags, **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(scope="module")
def kv_daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("kvd"), "--metrics-port", "0")
    yield d
    d.kill()


@pytest.fixture
def two_tenant_daemon(tmp_path):
    d = start_daemon(tmp_path / "d", "--token", "alice-token=alice", "--token", "bob-token=bob",
                     "--shm-dir", str(tmp_path), cpu_bytes="16MiB", nvme_bytes="64MiB")
    yield d
    if d.alive():
        d.stop()

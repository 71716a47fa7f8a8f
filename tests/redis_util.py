"""A real Redis for tests: the machine's on 6379, or a private ``redis-server`` on a free port.

Fixtures ``redis_url`` (module-scoped) and ``prefix`` (a key prefix of one test's own, deleted
afterwards) are registered in conftest.py; ``start_redis`` starts a private server for tests that
stop and restart Redis under a running fleet.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


@pytest.fixture(scope="module")
def redis_url():
    """The machine's Redis at 6379, or one started for this module if there is none."""
    try:
        redis.Redis(port=6379, socket_connect_timeout=0.5).ping()
        yield "redis://127.0.0.1:6379/0"
        return
    except redis.ConnectionError:
        pass
    proc = start_redis(port := free_port())
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


@pytest.fixture
def prefix(redis_url):
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    p = f"kvstest-{uuid.uuid4().hex[:12]}"
    yield p
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        r.delete(*keys)

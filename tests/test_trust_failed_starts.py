"""A ``kvstore serve`` that fails to start leaves nothing behind (issue 35, item 8).

Each case is a real ``kvstore serve`` process that gets as far as creating its CPU arena (a file
in the RAM-backed ``shm_dir``) and its Unix-socket services, then fails at a later step: the
metrics port is taken, the NVMe path cannot be a directory, the Redis client refuses the Redis tier's
or the fleet's URL. It must exit non-zero naming the step, and leave no arena file, no
socket and no ready file in ``shm_dir``: before, each left the whole arena in /dev/shm until the
next start (256 MiB here, 8 GiB with deploy/config.yaml).
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from kvstore.ops.local_daemon import serve_command


def listening_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def serve(tmp_path, *flags: str, config: str = "") -> subprocess.CompletedProcess:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    args = ["--listen", "127.0.0.1:0", "--shm-dir", str(shm_dir), "--cpu-bytes", "256MiB",
            "--nvme-bytes", "64MiB", "--ready-file", str(shm_dir / "ready.json"), *flags]
    if "--nvme-path" not in flags:
        args += ["--nvme-path", str(tmp_path / "nvme")]
    if config:
        (tmp_path / "kv.yaml").write_text(config)
        args += ["--config", str(tmp_path / "kv.yaml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(serve_command(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def left_behind(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "shm"))


@pytest.mark.parametrize("tokens", [False, True], ids=["one-arena-file", "tenant-segments"])
def test_metrics_port_taken(tmp_path, tokens):
    """The arena, the gRPC port and every Unix socket exist by the time the metrics port is bound."""
    taken = listening_port()
    try:
        done = serve(tmp_path, "--metrics-port", str(taken.getsockname()[1]),
                     *(["--token", "t-token=t"] if tokens else []))
    finally:
        taken.close()
    assert done.returncode != 0, done.stdout
    assert left_behind(tmp_path) == [], done.stderr[-2000:]


def test_nvme_path_not_a_directory(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    done = serve(tmp_path, "--nvme-path", str(tmp_path / "a-file" / "nvme"))
    assert done.returncode != 0, done.stdout
    assert left_behind(tmp_path) == [], done.stderr[-2000:]


def test_redis_tier_url_the_client_refuses(tmp_path):
    """A URL the configuration accepts (its scheme) that the Redis client refuses once the arena exists."""
    done = serve(tmp_path, config="redis_tier:\n  enabled: true\n  url: 'redis://127.0.0.1:99999/0'\n")
    assert done.returncode != 0, done.stdout
    assert left_behind(tmp_path) == [], done.stderr[-2000:]
    assert "Port out of range" in done.stderr, done.stderr[-2000:]


def test_fleet_redis_url_the_client_refuses(tmp_path):
    """The fleet is built after the server and its Unix sockets."""
    done = serve(tmp_path, config="fleet:\n  enabled: true\n  redis_url: 'redis://127.0.0.1:99999/0'\n"
                                  "  secret: 'a-fleet-secret-of-enough-length-0123456789'\n")
    assert done.returncode != 0, done.stdout
    assert left_behind(tmp_path) == [], done.stderr[-2000:]
    assert "Port out of range" in done.stderr, done.stderr[-2000:]

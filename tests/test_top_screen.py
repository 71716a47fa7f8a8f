"""``kvstore top`` on a real terminal: run live under tmux at 80x24 and at 120x40 against a real
daemon with eight namespaces, the screen captured and compared line by line with what is expected
(tests/golden/top-*.txt; the address, uptime, server id and poll interval are masked). At 80x24
the tiers, the hit rates, every counter and all eight namespaces fit with nothing cut; at 120x40
the occupancy bars and the activity table appear."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from daemon_util import start_daemon
from top_traffic import fill

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def masked(screen: str, address: str) -> str:
    text = screen.replace(address, "ADDRESS")
    text = re.sub(r"up \d+s", "up Ns", text)
    text = re.sub(r"server [0-9a-f]{8,}", "server ID", text)
    text = re.sub(r"over \d+\.\ds", "over Ts", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n") + "\n"


def capture_top(address: str, columns: int, rows: int) -> str:
    """The screen of a live ``kvstore top`` in a tmux window of ``columns`` x ``rows``, once it shows
    the namespaces and a poll-to-poll rate (a private tmux server, gone afterwards)."""
    socket = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket]
    command = f"{sys.executable} -P -m kvstore.ops.cli top --url {address} --interval 0.5"
    subprocess.run([*tmux, "new-session", "-d", "-x", str(columns), "-y", str(rows), command], check=True,
                   env={k: v for k, v in os.environ.items() if not k.startswith("TMUX")}, timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True, timeout=30).stdout
            if "acme/chat-v1" in screen and "over " in screen:
                time.sleep(1.0)   # one more poll: the frame has settled
                return subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True,
                                      timeout=30).stdout
            assert time.monotonic() < deadline, screen
            time.sleep(0.3)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def busy_daemon(tmp_path_factory):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/test.sh installs it)")
    d = start_daemon(tmp_path_factory.mktemp("top"), cpu_bytes="64MiB", nvme_bytes="256MiB")
    fill(d.address)
    yield d
    d.stop()


@pytest.mark.parametrize("columns, rows", [(80, 24), (120, 40)])
def test_top_screen_matches_what_is_expected(busy_daemon, columns, rows):
    screen = masked(capture_top(busy_daemon.address, columns, rows), busy_daemon.address)
    lines = screen.splitlines()
    assert len(lines) < rows and max(map(len, lines)) <= columns
    assert "..." not in screen and "…" not in screen
    with open(os.path.join(GOLDEN, f"top-{columns}x{rows}.txt")) as f:
        expected = f.read()
    assert screen == expected, "\n" + screen

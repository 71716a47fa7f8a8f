"""The daemon's HTTP port against slow and hostile clients (issue 35, item 4), on a real
``kvstore serve`` in fleet mode (so ``/v1/route`` answers) and real attacker processes.

Before: the timeout was per read and a 32-slot semaphore was held for a whole connection, so 40
connections sending one header byte every 2 s made every scrape and route call answer 503 for as
long as they lasted; half a MiB of nested JSON got no answer and a RecursionError traceback in
the log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from daemon_util import start_daemon
from fleet_util import write_fleet_config
from kvstore import KVLayout, Namespace
from kvstore.ops.http_probe import timed_request

SLOW_CLIENT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "reliability_scenarios",
                           "slow_http_client.py")   # a script run as its own process (tests never import benchmarks/)
SLOW_CLIENTS = 100
HELD_S = 14.0          # longer than the daemon's whole-request deadline (10 s)
LAYOUT = KVLayout(model="test/http-trust", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, redis_url):
    workdir = tmp_path_factory.mktemp("http-trust")
    config = write_fleet_config(workdir, redis_url, f"kvstest-{uuid.uuid4().hex[:12]}", "http-trust")
    d = start_daemon(workdir, "--config", config, "--metrics-port", "0", cpu_bytes="16MiB", nvme_bytes="64MiB")
    yield d
    assert d.stop() == 0


def test_metrics_and_route_answer_while_slow_clients_are_held(daemon):
    with daemon.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="http"))
    route = json.dumps({"namespace_id": ns.hex(), "token_ids": list(range(64))}).encode()
    attacker = subprocess.Popen([sys.executable, SLOW_CLIENT,
                                 str(daemon.metrics_port), str(SLOW_CLIENTS), str(HELD_S)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().strip() == "ready"
        answers = []
        end = time.monotonic() + HELD_S - 2
        while time.monotonic() < end:
            answers.append(("metrics",) + timed_request(daemon.metrics_port, "GET", "/metrics"))
            answers.append(("route",) + timed_request(daemon.metrics_port, "POST", "/v1/route", route))
            time.sleep(0.2)
        outcome = json.loads(attacker.stdout.readline())
    finally:
        attacker.kill()
        attacker.wait()
    statuses = sorted({(what, status) for what, status, _ in answers})
    assert statuses == [("metrics", 200), ("route", 200)], statuses
    slowest = max(seconds for _, _, seconds in answers)
    assert slowest < 5.0, f"an answer took {slowest:.2f} s while slow clients were held"   # (latency: the benchmark)
    # none of the slow connections outlived the whole-request deadline
    assert outcome == {"closed": SLOW_CLIENTS, "open": 0}, outcome


def test_a_slow_body_is_cut_at_the_whole_request_deadline(daemon):
    """Headers complete, body one byte a second: the answer is 408 at the deadline (10 s), not
    a connection held for as long as the client likes."""
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=20) as s:
        s.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        s.setblocking(False)
        answer = b""
        while time.monotonic() - t0 < 16 and not answer:
            try:
                answer = s.recv(4096)
                break
            except BlockingIOError:
                pass
            try:
                s.send(b" ")
            except OSError:
                break
            time.sleep(1.0)
        took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert 9.0 < took < 13.0, took


@pytest.mark.parametrize("body,why", [
    (b"[" * (512 << 10), "nested arrays"),
    (b'{"a":' * (100 << 10) + b"1" + b"}" * (100 << 10), "nested objects"),
    (b"\xff\xfe not json", "not JSON"),
    (b'{"namespace_id": 7}', "a field of the wrong type"),
])
def test_hostile_bodies_get_a_status_never_a_traceback(daemon, body, why):
    status, _ = timed_request(daemon.metrics_port, "POST", "/v1/route", body)
    assert status == 400, (why, status)
    assert "Traceback" not in daemon.log(), daemon.log()[-3000:]
    assert timed_request(daemon.metrics_port, "GET", "/metrics")[0] == 200


@pytest.mark.parametrize("raw", [
    b"GET /metrics HTTP/1.1\r\n" + b"X-Long: " + b"a" * (64 << 10) + b"\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
    b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",
])
def test_malformed_requests_get_a_status(daemon, raw):
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=5) as s:
        s.sendall(raw)
        answer = s.recv(4096)
    assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 413", b"HTTP/1.1 431"), answer[:100]
    assert "Traceback" not in daemon.log()


def is_open(s: socket.socket) -> bool:
    """Whether the server still holds this idle connection (no answer, no EOF)."""
    try:
        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def idle_from(source: str, port: int, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        conns.append(s)
        time.sleep(0.01)   # in order: the server pushes out the one that has waited longest
    return conns


def test_the_connection_cap_is_per_client_address(daemon):
    """64 idle connections from 127.0.0.2 and then 70 from 127.0.0.1: the 70 push out only their
    own 6 oldest, never the other address's, and a scrape still answers."""
    other = idle_from("127.0.0.2", daemon.metrics_port, 64)
    mine = idle_from("127.0.0.1", daemon.metrics_port, 70)
    try:
        time.sleep(0.5)
        assert [is_open(s) for s in other] == [True] * 64
        assert [is_open(s) for s in mine] == [False] * 6 + [True] * 64
        assert timed_request(daemon.metrics_port, "GET", "/metrics")[0] == 200
        assert [is_open(s) for s in other] == [True] * 64    # the scrape pushed out one of 127.0.0.1's
    finally:
        for s in other + mine:
            s.close()

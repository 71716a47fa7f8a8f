"""The base every socket server runs on (``transport.socket_server``) when its process runs out of
descriptors: a real side-channel server in a process of its own under a low ``RLIMIT_NOFILE``, and
a real flood of silent connections from this one."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import psutil

from kvstore.transport.bulk import BulkChannel

SERVER = textwrap.dedent("""
    import os, resource, sys
    from kvstore.transport.bulk_server import BulkServer
    server = BulkServer("127.0.0.1")
    ticket = server.ticket_for("t")
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (len(os.listdir("/proc/self/fd")) + 16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(server.port, ticket.hex(), flush=True)
    sys.stdin.readline()
    print(server.counts["accept_failed"], flush=True)
    sys.stdin.readline()
""")
FLOOD = 100


def test_out_of_descriptors_the_server_backs_off_and_serves_again_once_they_free_up():
    """16 descriptors to spare and 100 silent connections: accept fails with EMFILE, the server
    does not spin on its ready listener (little CPU while the flood holds), and once the flood
    goes a real client opens a session."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    flood = []
    try:
        port, ticket = server.stdout.readline().split()
        port, ticket = int(port), bytes.fromhex(ticket)
        for _ in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        proc = psutil.Process(server.pid)
        before = sum(proc.cpu_times()[:2])
        time.sleep(3.0)
        busy = sum(proc.cpu_times()[:2]) - before
        assert busy < 0.3, f"the server used {busy:.2f}s of CPU in 3s while out of descriptors"
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.monotonic() + 10
        while True:   # the flood's connections leave the backlog as they are accepted and read EOF
            try:
                channel = BulkChannel("127.0.0.1", port, ticket, 5.0)
                break
            except OSError:
                assert time.monotonic() < deadline, "no session within 10 s of the flood leaving"
                time.sleep(0.2)
        assert channel.alive()
        channel.close()
        server.stdin.write("\n")
        server.stdin.flush()
        failed = int(server.stdout.readline())
        assert failed > 0, "accept never failed: the test did not exhaust the server's descriptors"
        server.stdin.write("\n")
        server.stdin.flush()
        server.wait(10)
        warnings = server.stderr.read().count("accept failed")
        assert 1 <= warnings < failed or failed == 1, f"{warnings} warnings for {failed} failed accepts"
    finally:
        for s in flood:
            s.close()
        server.kill()
        server.wait()

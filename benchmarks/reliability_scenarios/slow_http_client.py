"""A slowloris attacker, run as its own process: ``python slow_http_client.py PORT N SECONDS``
(benchmarks/reliability.py http_slowloris, tests/test_trust_http.py).

Opens N connections to 127.0.0.1:PORT and sends each one byte of a request's headers every
second, never finishing them, for SECONDS. Prints "ready" once all N are open, then at the end a
JSON line: how many connections the server closed (refused, timed out or pushed out) and how
many it still held open.
"""

from __future__ import annotations

import json
import socket
import sys
import time

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096


def main(port: int, n: int, seconds: float) -> None:
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        conns.append(s)
    print("ready", flush=True)
    closed: set[int] = set()
    end = time.monotonic() + seconds
    at = 0
    while time.monotonic() < end:
        for i, s in enumerate(conns):
            if i in closed:
                continue
            try:
                s.recv(4096)   # an answer (408, 503) or EOF to a request never finished: the server let go
                closed.add(i)
                continue
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
                continue
            try:
                s.send(REQUEST[at:at + 1])
            except OSError:
                closed.add(i)
        at += 1
        time.sleep(1.0)
    print(json.dumps({"closed": len(closed), "open": n - len(closed)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))

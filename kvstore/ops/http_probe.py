"""One timed HTTP request to a daemon's HTTP endpoint (``/metrics``, ``/v1/route``), for the trust
tests and reliability scenarios that measure how it answers while hostile clients hold it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request


def timed_request(port: int, method: str, path: str, body: bytes | None = None,
                  timeout_s: float = 10.0) -> tuple[int, float]:
    """(HTTP status, seconds it took) of one request to ``127.0.0.1:port``; a connection the
    server drops, or one that times out, counts as status 0."""
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    except (urllib.error.URLError, OSError):
        status = 0
    return status, time.perf_counter() - t0

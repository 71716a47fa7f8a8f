"""Scenario churn: clients coming and going, and idle connections parked on the side-channel port.

Phase 1 (churn): ``cycles`` clients each connect with ``transport="bulk"``, register, read one
block and close. Passes when every one of them got the side channel, the daemon's bulk sessions
and open descriptors end within ``SLACK`` of where they began, and the next client still gets bulk.

Phase 2 (idle): an attacker keeps ``idle_connections`` TCP connections open to the bulk port for
``hold_s`` (reopening each one the daemon closes, once a second; a third of them send half a
greeting), and 64 unary gRPC calls that never send their message plus 64 stalled Put streams
(each reopened when the daemon cuts it), while a legitimate client probes health and a 1 MiB get every 50 ms. Passes when both
answer within ``P99_LIMIT_MS`` at p99 and the daemon's thread count stays flat.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import psutil

from kvstore import Namespace
from kvstore.client import Client
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb

from .common import KiB, MiB, daemon_log_errors, hashes, is_exact, layout, payload

SLACK = 8              # sessions / descriptors allowed above the baseline after churn
P99_LIMIT_MS = 100.0   # health and a 1 MiB get, at p99, while the port is flooded with idle connections
THREAD_SLACK = 3       # daemon threads allowed above the baseline while connections idle ...
RPC_WORKERS = 16       # ... plus the RPC worker pool (config `workers`, default 16), which grows to its
                       # size on demand: threads are bounded by the pool, not by idle connections or calls


def _latency_ms(samples: list[float]) -> dict:
    if not samples:
        return {"n": 0}
    ms = np.asarray(samples) * 1e3
    return {"n": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 2)}


def _settle(read, limit: int, timeout_s: float = 10.0) -> int:
    """``read()`` once it is at most ``limit`` (or its last value after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value <= limit or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def _churn_phase(d, observer: Client, daemon: psutil.Process, ns: bytes, hs: list[bytes], bb: int,
                 cycles: int) -> dict:
    sessions = lambda: observer.stats()["server"]["bulk_sessions"]  # noqa: E731
    sessions_before, fds_before = sessions(), daemon.num_fds()
    fallbacks = wrong = 0
    t0 = time.monotonic()
    for _ in range(cycles):
        with Client(d.address, transport="bulk") as c:
            c.register_namespace(Namespace(layout(bb)))
            wrong += not is_exact(hs[0], c.get(ns, hs[:1])[0], bb)
            fallbacks += c.active_transport != "bulk"
    wall = time.monotonic() - t0
    sessions_after = _settle(sessions, sessions_before + SLACK)
    fds_after = _settle(daemon.num_fds, fds_before + SLACK)
    with Client(d.address, transport="bulk") as nxt:
        next_transport = nxt.active_transport
    return {"cycles": cycles, "cycles_per_s": round(cycles / wall, 1), "fell_back_to_grpc": fallbacks,
            "wrong_bytes": wrong, "bulk_sessions_before": sessions_before, "bulk_sessions_after": sessions_after,
            "fds_before": fds_before, "fds_after": fds_after, "next_client_transport": next_transport,
            "ok": (fallbacks == 0 and wrong == 0 and sessions_after <= sessions_before + SLACK
                   and fds_after <= fds_before + SLACK and next_transport == "bulk")}


class _IdleFlood:
    """Keeps ``n`` silent connections open to ``port``, reopening those the daemon closes each second."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.opened = self.closed_by_daemon = 0
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        if i % 3 == 0:
            s.send(b"KVS")   # half a greeting, never finished
        self.opened += 1
        return s

    def _run(self) -> None:
        self._socks = [self._open(i) for i in range(self.n)]
        while not self._stop.wait(1.0):
            for i, s in enumerate(self._socks):
                try:
                    gone = s.recv(64) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    s.close()
                    self.closed_by_daemon += 1
                    self._socks[i] = self._open(i)

    def __enter__(self) -> "_IdleFlood":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for s in self._socks:
            s.close()


class _IdleCallFlood:
    """``n`` unary Lookup calls that send headers and never their message, and ``n`` Put streams
    that stall (half before their first message, half after a header and 1 kB), each reopened
    as soon as the daemon cuts it, for as long as the flood lasts: callers that hold a call open
    and send nothing, no token needed."""

    def __init__(self, address: str, n: int, namespace_id: bytes, block_bytes: int) -> None:
        import grpc

        self.namespace_id, self.block_bytes = namespace_id, block_bytes

        self.channel = grpc.insecure_channel(address)
        service = "/" + pb.DESCRIPTOR.services_by_name["KVStore"].full_name
        self.lookup = self.channel.stream_unary(f"{service}/Lookup",
                                                request_serializer=pb.LookupRequest.SerializeToString,
                                                response_deserializer=pb.LookupResponse.FromString)
        self.put = self.channel.stream_unary(f"{service}/Put", request_serializer=pb.PutChunk.SerializeToString,
                                             response_deserializer=pb.PutResponse.FromString)
        self.stop = threading.Event()
        self.opened = self.cut = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._hold, args=(kind, i), daemon=True)
                        for kind in ("unary", "stream") for i in range(n)]

    def _silence(self, first: list):
        yield from first
        self.stop.wait()

    def _hold(self, kind: str, i: int) -> None:
        while not self.stop.is_set():
            first = []
            if kind == "stream" and i % 2:
                first = [pb.PutChunk(header=pb.PutHeader(namespace_id=self.namespace_id, block_bytes=self.block_bytes,
                                                         hashes=[bytes([i % 256]) * 16]), data=b"\0" * 1000)]
            call = (self.lookup if kind == "unary" else self.put).future(self._silence(first))
            with self._lock:
                self.opened += 1
            try:
                call.result()
            except Exception:  # noqa: BLE001 - the daemon cut it (CANCELLED) or we closed the channel
                pass
            if not self.stop.is_set():
                with self._lock:
                    self.cut += 1

    def __enter__(self) -> "_IdleCallFlood":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.channel.close()
        for t in self.threads:
            t.join(timeout=5)


def _idle_phase(d, observer: Client, daemon: psutil.Process, connections: int, hold_s: float,
                idle_calls: int = 64) -> dict:
    big = 1 * MiB
    hs = hashes(1, seed=4242)
    with Client(d.address, transport="bulk") as legit:
        ns = legit.register_namespace(Namespace(layout(big)))
        legit.put(ns, hs, [payload(hs[0], big)])
        port = legit.call("Handshake", pb.HandshakeRequest()).bulk_port
        legit.get(ns, hs)
        threads_before = daemon.num_threads()
        health_s: list[float] = []
        get_s: list[float] = []
        wrong = failed = threads_max = 0
        with _IdleFlood(port, connections) as flood, _IdleCallFlood(d.address, idle_calls, ns, big) as calls:
            end = time.monotonic() + hold_s
            while time.monotonic() < end:
                t0 = time.perf_counter()
                failed += not legit.health()
                health_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                try:
                    wrong += not is_exact(hs[0], legit.get(ns, hs)[0], big)
                except Exception:  # noqa: BLE001 - counted, the probe goes on
                    failed += 1
                get_s.append(time.perf_counter() - t0)
                threads_max = max(threads_max, daemon.num_threads())
                time.sleep(0.05)
            with Client(d.address, transport="bulk") as fresh:
                fresh_transport = fresh.active_transport
            transport = legit.active_transport
        health, get = _latency_ms(health_s), _latency_ms(get_s)
        bulk = observer.stats()["server"].get("bulk_channel", {})
    return {"idle_connections": connections, "idle_unary_calls": idle_calls, "stalled_put_streams": idle_calls,
            "idle_calls_opened": calls.opened, "idle_calls_cut_by_daemon": calls.cut,
            "hold_s": hold_s, "connections_opened": flood.opened,
            "closed_by_daemon": flood.closed_by_daemon, "health_latency": health, "get_1mib_latency": get,
            "probe_failures": failed, "wrong_bytes": wrong, "legit_transport": transport,
            "fresh_client_transport_during_flood": fresh_transport,
            "daemon_threads_before": threads_before, "daemon_threads_max": threads_max, "bulk_channel": bulk,
            "ok": (failed == 0 and wrong == 0 and transport == "bulk"
                   and health.get("p99_ms", 1e9) <= P99_LIMIT_MS and get.get("p99_ms", 1e9) <= P99_LIMIT_MS
                   and threads_max <= threads_before + RPC_WORKERS + THREAD_SLACK)}


def churn(workdir: str, cycles: int = 10_000, idle_connections: int = 300, hold_s: float = 30.0,
          block_bytes: int = 16 * KiB) -> dict:
    d = start_local_daemon(workdir)
    try:
        daemon = psutil.Process(d.pid)
        with Client(d.address, transport="grpc") as observer:
            hs = hashes(1, seed=99)
            ns = observer.register_namespace(Namespace(layout(block_bytes)))
            observer.put(ns, hs, [payload(hs[0], block_bytes)])
            with Client(d.address, transport="bulk") as warm:   # the daemon's first bulk client: lazy set-up
                warm.register_namespace(Namespace(layout(block_bytes)))
                warm.get(ns, hs)
            time.sleep(0.5)
            r = {"churn": _churn_phase(d, observer, daemon, ns, hs, block_bytes, cycles),
                 "idle": _idle_phase(d, observer, daemon, idle_connections, hold_s)}
        r["daemon_alive"] = d.alive()
        r["daemon_log_errors"] = daemon_log_errors(d)
    finally:
        d.stop()
    r["ok"] = r["churn"]["ok"] and r["idle"]["ok"] and r["daemon_alive"] and not r["daemon_log_errors"]
    return r

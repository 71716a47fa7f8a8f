"""Idle and unauthenticated callers, and secrets, against real ``kvstore serve`` daemons (issue #17, 2 and 8).

Idle callers: an attacker process holds 64 unary calls that sent their headers and never their
request message, plus 64 Put streams that stall (half before their first message, half after a
header and a few bytes), and reopens each one as soon as the daemon ends it. Meanwhile health and a
legitimate 1 MiB put and get each answer within 100 ms at p99, with auth off and with auth on.
With auth off the stalled calls are cut once they have made no progress for the daemon's stall
bound (2 x lease_seconds, at least 1 s; 2 s here with --lease-seconds 1); with auth on they are
refused from their headers, before any request message, with a status that does not repeat the
offered token.

Secrets: a config error, the daemon's log, Stats and the metrics never show a token.

Run as a script, this file is the attacker: ``python test_trust_service.py ADDRESS SECONDS ...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

SERVICE = "/kvstore.v1.KVStore"
STALL_BOUND_S = 2.0             # 2 x --lease-seconds 1
HELD = 64                       # unary calls and Put streams each
ATTACK_S = 10.0
LEGIT_TOKEN = "legit-token-4f1d9c"
GUESSED_TOKEN = "guessed-token-a77e02"


# -- the attacker (a process of its own, so its threads do not share the measuring client's GIL) --

def attack(address: str, seconds: float, held: int, token: str, namespace_hex: str, block_bytes: int) -> dict:
    import grpc

    from kvstore.proto import kvstore_pb2 as pb

    channel = grpc.insecure_channel(address)
    never = threading.Event()
    lookup = channel.stream_unary(f"{SERVICE}/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                  response_deserializer=pb.LookupResponse.FromString)
    put = channel.stream_unary(f"{SERVICE}/Put", request_serializer=pb.PutChunk.SerializeToString,
                               response_deserializer=pb.PutResponse.FromString)

    def no_message():
        # on the wire: a unary call whose request message never comes
        never.wait()
        yield from ()

    def stalled_put(with_header: bool):
        if with_header:
            header = pb.PutHeader(namespace_id=bytes.fromhex(namespace_hex), block_bytes=block_bytes,
                                  hashes=[os.urandom(16) for _ in range(4)])
            yield pb.PutChunk(header=header, data=b"\0" * 1000)
        never.wait()

    deadline = time.monotonic() + seconds
    ended: list[tuple[str, str, str, float]] = []
    opened = threading.Semaphore(0)

    def slot(kind: str, i: int) -> None:
        metadata = (("authorization", f"Bearer {token}"),) if token and i % 2 else ()
        first = True
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            if kind == "unary":
                call = lookup.future(no_message(), metadata=metadata, timeout=seconds + 30)
            else:
                call = put.future(stalled_put(bool(namespace_hex) and i % 2 == 1), metadata=metadata,
                                  timeout=seconds + 30)
            if first:
                opened.release()
                first = False
            try:
                call.result(timeout=max(0.01, deadline - time.monotonic()))
                code, details = "OK", ""
            except grpc.FutureTimeoutError:
                call.cancel()   # still held when the attack ends
                return
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
            ended.append((kind, code, details, round(time.monotonic() - t0, 3)))
            time.sleep(0.5)

    threads = [threading.Thread(target=slot, args=(kind, i), daemon=True)
               for kind in ("unary", "put") for i in range(held)]
    for t in threads:
        t.start()
    for _ in threads:
        opened.acquire()
    time.sleep(0.5)
    print("ready", flush=True)
    for t in threads:
        t.join(seconds + 60)
    never.set()
    channel.close()
    return {"ended": ended}


if __name__ == "__main__":
    address, seconds, held, token, namespace_hex, block_bytes = sys.argv[1:7]
    print(json.dumps(attack(address, float(seconds), int(held), token, namespace_hex, int(block_bytes))), flush=True)
    sys.exit(0)


# -- the tests ------------------------------------------------------------------------------------

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvstore import KVLayout, Namespace  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.proto import kvstore_pb2_grpc as pb_grpc  # noqa: E402

LAYOUT = KVLayout(model="trust/idle", num_layers=1, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256)


def _start_attacker(address: str, token: str, namespace: bytes, block_bytes: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, address, str(ATTACK_S), str(HELD), token,
                             namespace.hex(), str(block_bytes)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _legit_traffic(client, ns: bytes, seconds: float) -> tuple[dict[str, list[float]], list[str]]:
    """Health, then a fresh 1 MiB put and its get, again and again: each one's latency."""
    block = np.random.default_rng(5).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
    latency: dict[str, list[float]] = {"health": [], "put": [], "get": []}
    failures: list[str] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        h = i.to_bytes(8, "little") + os.urandom(8)
        i += 1
        for op, call in (("health", client.health), ("put", lambda: client.put(ns, [h], [block])),
                         ("get", lambda: client.get(ns, [h]))):
            t0 = time.perf_counter()
            try:
                out = call()
            except Exception as e:  # noqa: BLE001 - a failure is recorded, not raised mid-measurement
                out = e
            latency[op].append(time.perf_counter() - t0)
            ok = {"health": out is True, "put": out == ["stored"], "get": out == [block.tobytes()]}[op]
            if not ok:
                failures.append(f"{op}: {out!r}"[:200])
        client.delete(ns, [h])   # keep the store small; not measured
    return latency, failures


@pytest.mark.parametrize("auth", [False, True], ids=["auth-off", "auth-on"])
def test_idle_callers_take_no_worker_and_are_cut(daemon_factory, auth):
    flags = ["--lease-seconds", "1", "--metrics-port", "0"]
    if auth:
        flags += ["--token", f"{LEGIT_TOKEN}=alice"]
    d = daemon_factory(*flags, cpu_bytes="128MiB", client_kwargs={"token": LEGIT_TOKEN if auth else None})
    with d.client(transport="grpc", timeout_s=2.0) as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        assert LAYOUT.block_bytes == 1 << 20
        attacker = _start_attacker(d.address, GUESSED_TOKEN if auth else "", b"" if auth else ns, LAYOUT.block_bytes)
        try:
            latency, failures = _legit_traffic(c, ns, ATTACK_S - 1.5)
            out, _ = attacker.communicate(timeout=ATTACK_S + 90)
        finally:
            attacker.kill()
        stats = c.stats()
    ended = json.loads(out.strip().splitlines()[-1])["ended"]

    assert not failures, failures[:5]
    p99 = {op: float(np.percentile(v, 99)) for op, v in latency.items()}
    assert all(len(v) >= 20 for v in latency.values()), {op: len(v) for op, v in latency.items()}
    assert all(v <= 0.100 for v in p99.values()), p99

    kinds = {kind for kind, *_ in ended}
    assert kinds == {"unary", "put"}, ended[:5]
    if auth:
        # refused from their headers, before any request message, never repeating the offered token
        assert {code for _, code, _, _ in ended} == {"UNAUTHENTICATED"}, ended[:5]
        assert max(lasted for *_, lasted in ended) < 1.0, sorted(ended, key=lambda e: -e[3])[:5]
        assert not [e for e in ended if GUESSED_TOKEN in e[2]]
        assert len(ended) >= 2 * HELD
    else:
        # cut once idle for the stall bound (checked every lease_seconds / 4), not before
        assert {code for _, code, _, _ in ended} == {"CANCELLED"}, ended[:5]
        lasted = [e[3] for e in ended]
        assert min(lasted) >= STALL_BOUND_S - 0.1 and max(lasted) <= STALL_BOUND_S + 3.0, (min(lasted), max(lasted))
        assert len(ended) >= 2 * HELD
        assert stats["server"]["stalled_streams_cancelled"] >= 2 * HELD
        assert stats["server"]["open_streams"] <= 2 * HELD
    with d.client(timeout_s=5.0) as c:
        assert c.health()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
    assert d.stop() == 0
    log = d.log()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
    # no secret in the log, Stats or metrics (with auth on: of a daemon that refused a guessed token)
    for text in (log, json.dumps(stats), metrics):
        assert LEGIT_TOKEN not in text and GUESSED_TOKEN not in text


def test_health_answers_while_every_worker_is_busy(daemon_factory):
    """Side-channel transfers whose bytes never come hold worker threads until they are cut;
    health is served on the event loop, not by a worker, so it answers throughout."""
    import socket

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.transport.bulk import MAGIC

    d = daemon_factory("--lease-seconds", "1", env={"KVSTORE_WORKERS": "2"})
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
    channel = grpc.insecure_channel(d.address)
    stub, health = pb_grpc.KVStoreStub(channel), health_pb2_grpc.HealthStub(channel)
    held = []
    try:
        sessions = []
        for _ in range(4):   # twice the workers: two transfers hold them, two wait for them
            hello = stub.Handshake(pb.HandshakeRequest())
            sock = socket.create_connection(("127.0.0.1", hello.bulk_port))
            sock.sendall(MAGIC + hello.bulk_ticket)
            sessions.append(sock.recv(16))
            held.append(sock)
        for sid in sessions:
            held.append(stub.BulkPut.future(pb.BulkRequest(namespace_id=ns, hashes=[os.urandom(16)] * 2,
                                                           block_bytes=LAYOUT.block_bytes, session=sid)))
        time.sleep(0.3)
        latency = []
        end = time.monotonic() + 3 * STALL_BOUND_S
        while time.monotonic() < end:
            t0 = time.perf_counter()
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            latency.append(time.perf_counter() - t0)
            assert status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.05)
        assert max(latency) <= 0.25, sorted(latency)[-5:]   # never waits for a worker
        stalled = [f for f in held if isinstance(f, grpc.Future)]
        assert all(f.done() for f in stalled)   # and the transfers were cut
        assert {f.exception().code() for f in stalled} <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT}
    finally:
        for h in held:
            h.close() if isinstance(h, socket.socket) else h.cancel()
        channel.close()


def test_put_stream_without_token_is_refused_before_its_first_message(daemon_factory):
    d = daemon_factory("--token", f"{LEGIT_TOKEN}=alice")
    never = threading.Event()

    def no_message():
        never.wait()
        yield from ()

    channel = grpc.insecure_channel(d.address)
    try:
        for metadata in ((), (("authorization", f"Bearer {GUESSED_TOKEN}"),)):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVStoreStub(channel).Put(no_message(), metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - t0 < 2.0          # answered from the headers: no message was ever sent
            assert ("kvstore-error", "Unauthenticated") in tuple(err.value.trailing_metadata())
            assert GUESSED_TOKEN not in (err.value.details() or "")
        # the same for a unary call that never sends its request
        lookup = channel.stream_unary(f"{SERVICE}/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                      response_deserializer=pb.LookupResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            lookup(no_message(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        never.set()
        channel.close()


@pytest.mark.parametrize("config", [
    "tokens:\n  {token}: 5\n",                   # a token mapped to a non-string tenant
    "tokens:\n  - {token}\n",                    # tokens written as a list
    "fleet:\n  peer_token: [{token}]\n",          # the peer token of the wrong type
])
def test_config_errors_never_echo_a_token(tmp_path, config):
    from kvstore.ops.local_daemon import serve_command

    token = "s3cret-config-token-91b2"
    path = tmp_path / "bad.yaml"
    path.write_text(config.format(token=token))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run(serve_command("--config", str(path)), capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "invalid configuration" in r.stderr
    assert token not in r.stderr and token not in r.stdout, r.stderr
    assert "<redacted>" in r.stderr


def test_a_malformed_token_flag_is_not_echoed(tmp_path):
    from kvstore.ops.local_daemon import serve_command

    token = "s3cret-flag-token-5c0d"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run(serve_command("--token", token), capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=env)
    assert r.returncode != 0
    assert "--token" in r.stderr and token not in r.stderr + r.stdout

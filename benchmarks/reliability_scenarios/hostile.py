"""Scenario 4, hostile input: a fuzzer over every RPC through the raw stubs, and slowloris streams.

The daemon must answer every malformed request with a defined status, stay alive, leak no
leases, keep unrelated blocks exact, and keep serving normal clients while streams stall.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time

import grpc

from kvstore import Namespace
from kvstore.client import Client
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

from .common import KiB, daemon_log_errors, hashes, is_exact, layout, payload


# -- 4. hostile input ------------------------------------------------------------------------------

# Answers the daemon may give to bad input. INTERNAL only as gRPC's own "cannot parse" answer.
DEFINED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE",
           "PERMISSION_DENIED", "UNAUTHENTICATED", "DATA_LOSS", "UNIMPLEMENTED"}
UNARY = {"Handshake": (pb.HandshakeRequest, pb.HandshakeResponse),
         "RegisterNamespace": (pb.RegisterNamespaceRequest, pb.RegisterNamespaceResponse),
         "Lookup": (pb.LookupRequest, pb.LookupResponse), "LookupBatch": (pb.LookupBatchRequest, pb.LookupBatchResponse),
         "Exists": (pb.ExistsRequest, pb.ExistsResponse), "Delete": (pb.DeleteRequest, pb.DeleteResponse),
         "Stats": (pb.StatsRequest, pb.StatsResponse), "PrepareStore": (pb.PrepareStoreRequest, pb.LeaseResponse),
         "CompleteStore": (pb.LeaseRequest, pb.PutResponse), "AbortStore": (pb.LeaseRequest, pb.Empty),
         "PrepareLoad": (pb.PrepareLoadRequest, pb.LeaseResponse), "CompleteLoad": (pb.LeaseRequest, pb.Empty),
         "BulkGet": (pb.BulkRequest, pb.BulkGetResponse), "BulkPut": (pb.BulkRequest, pb.PutResponse)}


class _Nasty:
    """Hostile field values: wrong lengths, wrong types' bytes, boundaries, other namespaces."""

    def __init__(self, rng: random.Random, good_ns: list[bytes], good_hashes: list[bytes]) -> None:
        self.rng = rng
        self.good_ns = good_ns
        self.good_hashes = good_hashes

    def blob(self) -> bytes:
        r = self.rng
        return r.choice([b"", b"\x00", os.urandom(r.choice([1, 15, 16, 17, 32, 64, 65, 200])),
                         r.choice(self.good_ns), r.choice(self.good_hashes), b"\xff" * r.choice([16, 64, 4096])])

    def ns(self) -> bytes:
        return self.rng.choice(self.good_ns) if self.rng.random() < 0.6 else self.blob()

    def hash_list(self) -> list[bytes]:
        r = self.rng
        n = r.choice([0, 1, 2, 5, 64, 4096, 4097, 9000])
        if n > 100:
            return [os.urandom(16)] * n
        return [r.choice(self.good_hashes) if r.random() < 0.5 else self.blob() for _ in range(n)]

    def uint(self, bits: int = 64) -> int:
        return self.rng.choice([0, 1, 2, 4095, 4096, 16 * KiB, 64 * KiB, 1 << 31, (1 << bits) - 1,
                                self.rng.randrange(1 << bits)])

    def text(self) -> str:
        return self.rng.choice(["", "x", "bfloat16", "opaque", "\u0000\ud7ff\ufffd", "a" * 257, "m" * 5000,
                                "../../etc/passwd", "float8_e4m3fn"])

    def layout(self) -> pb.Layout:
        u = lambda: self.uint(32)  # noqa: E731
        return pb.Layout(model=self.text(), num_layers=u(), num_kv_heads=u(), head_dim=u(), dtype=self.text(),
                         block_tokens=u(), layout=self.text(), kv_per_token=u(), tp_rank=u(), tp_size=u(),
                         pp_rank=u(), pp_size=u(), cp_rank=u(), cp_size=u(), block_bytes=self.uint())

    def request(self, method: str):
        n, r = self, self.rng
        if method == "Handshake":
            return pb.HandshakeRequest(nonce=n.blob(), client_version=n.uint(32))
        if method == "RegisterNamespace":
            return pb.RegisterNamespaceRequest(layout=n.layout(), cache_salt=n.text(), tenant=n.text()) \
                if r.random() < 0.8 else pb.RegisterNamespaceRequest(cache_salt=n.text())
        if method == "Lookup":
            return pb.LookupRequest(namespace_id=n.ns(), hashes=n.hash_list(), no_lease=r.random() < 0.5)
        if method == "LookupBatch":
            k = r.choice([0, 1, 3, 1024, 1025, 3000])
            one = pb.LookupRequest(namespace_id=n.ns(), hashes=n.hash_list()[:8])
            return pb.LookupBatchRequest(requests=[one] * k)
        if method in ("Exists", "Delete"):
            return UNARY[method][0](namespace_id=n.ns(), hashes=n.hash_list())
        if method == "Stats":
            return pb.StatsRequest()
        if method == "PrepareStore":
            return pb.PrepareStoreRequest(namespace_id=n.ns(), hashes=n.hash_list(), parent=n.blob(),
                                          block_bytes=n.uint())
        if method == "PrepareLoad":
            return pb.PrepareLoadRequest(namespace_id=n.ns(), hashes=n.hash_list(), block_bytes=n.uint())
        if method in ("CompleteStore", "AbortStore", "CompleteLoad"):
            return pb.LeaseRequest(lease_id=n.uint())
        return pb.BulkRequest(namespace_id=n.ns(), hashes=n.hash_list(), parent=n.blob(), block_bytes=n.uint(),
                              session=n.blob())

    def put_stream(self, block_bytes: int) -> list:
        n, r = self, self.rng
        header = pb.PutHeader(namespace_id=n.ns(), hashes=n.hash_list()[:r.choice([1, 2, 8, 4097])],
                              parent=n.blob(), block_bytes=r.choice([0, block_bytes, n.uint()]),
                              codec=r.choice([0, 0, 1, 7, 2**32 - 1]))
        msgs = []
        if r.random() < 0.9:
            msgs.append(pb.PutChunk(header=header, data=b"\x01" * r.choice([0, 10, block_bytes])))
        for _ in range(r.choice([0, 1, 2, 5])):
            msgs.append(pb.PutChunk(data=b"\x02" * r.choice([0, 1, block_bytes, 2 * block_bytes])))
            if r.random() < 0.1:
                msgs.append(pb.PutChunk(header=header))
        return msgs


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    """Truncate, bit-flip, splice or replace a serialized message (malformed protobuf)."""
    kind = rng.randrange(4)
    if kind == 0 and raw:
        return raw[:rng.randrange(len(raw))]
    if kind == 1 and raw:
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:
        return raw + os.urandom(rng.randint(1, 64))
    return os.urandom(rng.randint(1, 256))


def _leak_check(c: Client, wait_s: float) -> dict:
    """After the hostile traffic stops and leases had time to expire: no lease, stream or slot leak."""
    deadline = time.monotonic() + wait_s
    while True:
        s = c.stats()
        cpu = s["tiers"]["cpu"]
        leaks = {"leases": s["leases"], "client_leases": s["server"].get("client_leases", 0),
                 "open_streams": s["server"].get("open_streams", 0),
                 "reserved_unpublished_cpu_slots": cpu["blocks"] - cpu["policy_blocks"]}
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks
        time.sleep(0.25)


def fuzz(workdir: str, requests: int = 300, seed: int = 7, block_bytes: int = 16 * KiB) -> dict:
    """Malformed, truncated, oversized and wrong-type requests to every RPC through the raw stubs."""
    rng = random.Random(seed)
    lease_s = 1.0
    d = start_local_daemon(os.path.join(workdir, "fuzz"), "--lease-seconds", str(lease_s), "--cpu-slot-bytes", "16KiB",
                     cpu_bytes="16MiB", nvme_bytes="64MiB")
    outcomes: dict[str, dict[str, int]] = {}
    undefined: list[str] = []
    try:
        with d.client(transport="grpc") as c:
            lay = layout(block_bytes, "reliability/fuzz")
            good_ns = [c.register_namespace(Namespace(lay)),
                       c.register_namespace(Namespace(layout(2 * block_bytes, "reliability/fuzz2")))]
            good_hashes = hashes(32, seed=seed)
            c.put(good_ns[0], good_hashes[:8], [payload(h, block_bytes) for h in good_hashes[:8]])
            # blocks the fuzzer never learns the namespace of: must come through untouched
            kept_ns = c.register_namespace(Namespace(lay, cache_salt="kept"))
            c.put(kept_ns, good_hashes[:8], [payload(h, block_bytes) for h in good_hashes[:8]])
            baseline = c.stats()["tiers"]["cpu"]["blocks"]
            nasty = _Nasty(rng, good_ns, good_hashes)
            channel = grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 64 << 20)])
            stub = pb_grpc.KVStoreStub(channel)
            methods = list(UNARY) + ["Put", "Get", "raw"]

            def record(method: str, code: str, details: str) -> None:
                outcomes.setdefault(method, {})
                outcomes[method][code] = outcomes[method].get(code, 0) + 1
                ok = code in DEFINED or (code == "INTERNAL" and "deserializ" in details.lower())
                if not ok:
                    undefined.append(f"{method}: {code}: {details[:200]}")

            for i in range(requests):
                method = methods[i % len(methods)]
                try:
                    if method == "Put":
                        stub.Put(iter(nasty.put_stream(block_bytes)), timeout=15)
                    elif method == "Get":
                        req = pb.GetRequest(namespace_id=nasty.ns(), hashes=nasty.hash_list(),
                                            block_bytes=rng.choice([0, block_bytes, nasty.uint()]),
                                            chunk_bytes=nasty.uint(32))
                        for _ in stub.Get(req, timeout=15):
                            pass
                    elif method == "raw":   # bytes that are not (quite) a message of the method's type
                        name = rng.choice(list(UNARY))
                        req = nasty.request(name)
                        call = channel.unary_unary(f"/kvstore.v1.KVStore/{name}", request_serializer=None,
                                                   response_deserializer=None)
                        call(_mutate(req.SerializeToString(), rng), timeout=15)
                        method = f"raw:{name}"
                    else:
                        getattr(stub, method)(nasty.request(method), timeout=15)
                    record(method, "OK", "")
                except grpc.RpcError as e:
                    record(method, e.code().name, e.details() or "")
            # oversized: one message above the daemon's 16 MiB limit
            try:
                stub.Exists(pb.ExistsRequest(namespace_id=good_ns[0], hashes=[b"\x01" * 64] * (300_000)), timeout=30)
                record("oversized", "OK", "")
            except grpc.RpcError as e:
                record("oversized", e.code().name, e.details() or "")
            channel.close()
            alive = d.alive() and c.health()
            leaks = _leak_check(c, wait_s=4 * lease_s + 3)
            after = c.stats()["tiers"]["cpu"]["blocks"]
            still_exact = sum(is_exact(h, g, block_bytes)
                              for h, g in zip(good_hashes[:8], c.get(kept_ns, good_hashes[:8])))
    finally:
        errors = daemon_log_errors(d)
        d.stop()
    total = sum(sum(v.values()) for v in outcomes.values())
    return {"requests": total, "undefined_answers": len(undefined), "undefined_examples": undefined[:5],
            "outcomes": outcomes, "daemon_alive": alive, "leaks": leaks, "cpu_blocks_before": baseline,
            "cpu_blocks_after": after, "stored_blocks_still_exact": still_exact, "daemon_log_errors": errors}


def slowloris(workdir: str, stallers: int = 24, block_bytes: int = 256 * KiB) -> dict:
    """Clients that open streams and stall, hold leases and vanish, or stop reading a Get: others are
    still served, the stalled streams are cut, and leases, slots and sessions return to baseline."""
    import queue

    lease_s = 1.0
    d = start_local_daemon(os.path.join(workdir, "slowloris"), "--lease-seconds", str(lease_s), "--cpu-slot-bytes",
                     str(block_bytes), cpu_bytes=str(64 * block_bytes), nvme_bytes="128MiB")
    held = []
    try:
        with d.client(transport="grpc", timeout_s=10) as c:
            lay = layout(block_bytes, "reliability/slow")
            ns = c.register_namespace(Namespace(lay))
            hs = hashes(16, seed=21)
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            base = c.stats()
            channel = grpc.insecure_channel(d.address)
            stub = pb_grpc.KVStoreStub(channel)
            gates = []

            def stalled_put(q):
                yield pb.PutChunk(header=pb.PutHeader(namespace_id=ns, hashes=hashes(4, seed=99), block_bytes=block_bytes),
                                  data=b"\x00" * 1000)
                q.get()

            kinds = {"stalled_put": 0, "unread_get": 0, "held_load_lease": 0, "held_store_lease": 0,
                     "stalled_bulk_put": 0}
            for i in range(stallers):
                kind = list(kinds)[i % len(kinds)]
                kinds[kind] += 1
                if kind == "stalled_put":
                    q = queue.Queue()
                    gates.append(q)
                    held.append(stub.Put.future(stalled_put(q)))
                elif kind == "unread_get":
                    it = stub.Get(pb.GetRequest(namespace_id=ns, hashes=hs * 16, chunk_bytes=64 * KiB))
                    next(it)      # read one message, then never again
                    held.append(it)
                elif kind == "held_load_lease":
                    stub.PrepareLoad(pb.PrepareLoadRequest(namespace_id=ns, hashes=hs[:4]))
                elif kind == "held_store_lease":
                    stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns, hashes=hashes(2, seed=100 + i)))
                else:
                    hs_ = pb.HandshakeRequest()
                    info = stub.Handshake(hs_)
                    s = socket.create_connection(("127.0.0.1", info.bulk_port))
                    s.sendall(b"KVSBULK1" + info.bulk_ticket)
                    sid = s.recv(16)
                    held.append(s)
                    held.append(stub.BulkPut.future(pb.BulkRequest(namespace_id=ns, hashes=hashes(2, seed=200 + i),
                                                                   block_bytes=block_bytes, session=sid)))
            time.sleep(0.3)
            t0 = time.monotonic()
            served = c.get(ns, hs[:2])
            first_answer_s = time.monotonic() - t0
            exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs[:2], served))
            leaks = _leak_check(c, wait_s=6 * lease_s + 5)
            after = c.stats()
            for q in gates:
                q.put(None)
            channel.close()
            alive = d.alive() and c.health()
    finally:
        for h in held:
            with contextlib.suppress(Exception):
                h.close() if isinstance(h, socket.socket) else h.cancel()
        errors = daemon_log_errors(d)
        d.stop()
    return {"stallers": kinds, "normal_client_answer_s": round(first_answer_s, 3), "normal_client_exact": exact,
            "leaks_after_expiry": leaks, "leases_expired": after["counters"].get("leases_expired", 0),
            "stalled_streams_cancelled": after["server"].get("stalled_streams_cancelled", 0),
            "cpu_blocks_before": base["tiers"]["cpu"]["blocks"], "cpu_blocks_after": after["tiers"]["cpu"]["blocks"],
            "daemon_alive": alive, "daemon_log_errors": errors}

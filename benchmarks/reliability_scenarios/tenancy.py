"""Scenario 5, tenancy: isolation between tenants, quotas under concurrent writers, lease hijack,
wrong tokens, sha256 block keys and TLS with a test CA.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading

import grpc
import numpy as np

from kvstore import Namespace
from kvstore.client import Client
from kvstore.client.shm_path import lease_slots
from kvstore.errors import KVStoreError
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

from .common import KiB, Unsupported, daemon_log_errors, hashes, is_exact, layout, payload


# -- 5. tenancy ------------------------------------------------------------------------------------

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_test_ca(where: str) -> dict:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost signed by it (openssl CLI)."""
    if shutil.which("openssl") is None:
        raise Unsupported("the openssl command is needed to make a test CA")
    p = {k: os.path.join(where, f"{k}.pem") for k in ("ca_key", "ca", "key", "csr", "cert")}
    ext = os.path.join(where, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", p["ca_key"], "-out", p["ca"],
             "-subj", "/CN=kvstore test CA")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p["key"], "-out", p["csr"], "-subj", "/CN=localhost")
    _openssl("x509", "-req", "-in", p["csr"], "-CA", p["ca"], "-CAkey", p["ca_key"], "-CAcreateserial", "-days", "1",
             "-out", p["cert"], "-extfile", ext)
    return p


def tenancy(workdir: str, writers: int = 8, block_bytes: int = 16 * KiB) -> dict:
    """Two tenants on one daemon (tokens, quota) and a TLS daemon with a test CA."""
    out: dict = {}
    quota_blocks = 20
    d = start_local_daemon(os.path.join(workdir, "tenants"), "--token", "alice-token=alice", "--token", "bob-token=bob",
                     "--token", "carol-token=carol", "--quota", f"carol={quota_blocks * block_bytes}",
                     cpu_bytes="32MiB", nvme_bytes="128MiB")
    lay = layout(block_bytes, "reliability/tenancy")
    try:
        alice, bob = d.client(token="alice-token", transport="bulk"), d.client(token="bob-token", transport="grpc")
        hs = hashes(8, seed=31)
        ns_a = alice.register_namespace(Namespace(lay))
        alice.put(ns_a, hs, [payload(h, block_bytes) for h in hs])
        ns_b = bob.register_namespace(Namespace(lay, tenant="alice"))   # claiming alice's tenant is ignored
        refused, leaked = {}, []
        probes = {"lookup": lambda: bob.lookup(ns_a, hs), "exists": lambda: bob.exists(ns_a, hs),
                  "get": lambda: bob.get_into(ns_a, hs[:1], [np.empty(block_bytes, np.uint8)]),
                  "delete": lambda: bob.delete(ns_a, hs), "put": lambda: bob.put(ns_a, hs[:1], [np.zeros(block_bytes, np.uint8)])}
        stub = pb_grpc.KVStoreStub(bob.channel)
        meta = (("authorization", "Bearer bob-token"),)
        probes["prepare_load"] = lambda: stub.PrepareLoad(pb.PrepareLoadRequest(namespace_id=ns_a, hashes=hs), metadata=meta)
        # same-host leases are offered under auth (in tenant segments), but never on another's namespace
        probes["prepare_store"] = lambda: stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns_a, hashes=hs), metadata=meta)
        for name, call in probes.items():
            try:
                call()
                leaked.append(name)
            except KVStoreError as e:
                refused[name] = type(e).__name__
            except grpc.RpcError as e:
                refused[name] = e.code().name
        # bob plants garbage under the very same hash bytes, in the only namespace he can write
        planted = bob.put(ns_b, hs, [np.zeros(block_bytes, np.uint8)] * len(hs))
        alice_exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, alice.get(ns_a, hs)))
        bob_stats = bob.stats()["server"]
        out["isolation"] = {"namespace_ids_differ": ns_a != ns_b, "refused": refused, "leaked": leaked,
                            "plant_attempt_results": sorted(set(planted)), "victim_blocks_exact": alice_exact,
                            "victim_blocks": len(hs), "bob_sees_tenant": bob_stats["tenant"],
                            "bob_sees_bytes": bob_stats["tenant_bytes"]}
        for token in (None, "Alice-token", "alice-tokeX", "x" * 11, "alice-token" * 100):
            with d.client(token=token) as wrong:
                try:
                    wrong.stats()
                    out.setdefault("bad_tokens_accepted", []).append(repr(token))
                except KVStoreError as e:
                    out.setdefault("bad_tokens_refused", {})[repr(token)[:20]] = type(e).__name__
        # quota under concurrent writers
        errors: dict[str, int] = {}
        stored = []
        lock = threading.Lock()

        def writer(w: int) -> None:
            with d.client(token="carol-token", transport=("grpc", "bulk")[w % 2]) as cl:
                ns = cl.register_namespace(Namespace(lay))
                mine = hashes(12, seed=1000 + w)
                for h in mine:
                    try:
                        r = cl.put(ns, [h], [payload(h, block_bytes)])[0]
                        with lock:
                            stored.append((h, r))
                    except KVStoreError as e:
                        with lock:
                            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with d.client(token="carol-token") as carol:
            ns_c = carol.register_namespace(Namespace(lay))
            used = carol.stats()["server"]["tenant_bytes"]
            ok = [h for h, _ in stored]
            got = carol.get(ns_c, ok)
        out["quota"] = {"writers": writers, "attempted_blocks": writers * 12, "quota_bytes": quota_blocks * block_bytes,
                        "tenant_bytes_after": used, "held": used <= quota_blocks * block_bytes,
                        "acknowledged": len(ok), "refusals": errors,
                        "acknowledged_served_exact": sum(is_exact(h, g, block_bytes) for h, g in zip(ok, got))}
        alice.close()
        bob.close()
    finally:
        out["daemon_log_errors"] = daemon_log_errors(d)
        d.stop()
    # lease ids cannot be guessed or hijacked (no auth: every client is the same tenant)
    d = start_local_daemon(os.path.join(workdir, "leases"), cpu_bytes="16MiB", nvme_bytes="64MiB")
    try:
        with d.client(transport="shm") as victim, d.client(transport="grpc") as thief:
            ns = victim.register_namespace(Namespace(lay))
            assert victim.active_transport == "shm"   # maps the arena
            hs = hashes(2, seed=41)
            lease = victim.call("PrepareStore", pb.PrepareStoreRequest(namespace_id=ns, hashes=hs, block_bytes=block_bytes))
            hijacked = 0
            for guess in list(range(1, 200)) + [lease.lease_id ^ 1, lease.lease_id + 1, lease.lease_id - 1]:
                with contextlib.suppress(KVStoreError):
                    thief.call("CompleteStore", pb.LeaseRequest(lease_id=guess))
                    hijacked += 1
            for blk, h in zip(lease_slots(lease)[0], hs):
                victim.mapped_arena.copy_in(blk.extents, payload(h, block_bytes))
            results = [r for r in victim.call("CompleteStore", pb.LeaseRequest(lease_id=lease.lease_id)).results]
            exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, victim.get(ns, hs)))
        out["lease_hijack"] = {"guesses": 202, "hijacked": hijacked, "victim_completed": len(results), "victim_exact": exact}
    finally:
        d.stop()
    # sha256 block keys travel and work like any other
    d = start_local_daemon(os.path.join(workdir, "sha"), cpu_bytes="16MiB", nvme_bytes="64MiB")
    try:
        with d.client() as c:
            ns = c.register_namespace(Namespace(lay, cache_salt="sha256"))
            hs = hashes(4, seed=51, algorithm="sha256")
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            out["sha256_keys"] = {"hash_bytes": len(hs[0]), "lookup_hits": c.lookup(ns, hs).num_hit,
                                  "exact": sum(is_exact(h, g, block_bytes) for h, g in zip(hs, c.get(ns, hs)))}
    finally:
        d.stop()
    # TLS with a test CA
    try:
        ca = make_test_ca(tempfile.mkdtemp(prefix="kvstore-ca-", dir=workdir))
    except Unsupported as e:
        out["tls"] = {"skipped": str(e)}
        return out
    d = start_local_daemon(os.path.join(workdir, "tls"), "--tls-cert", ca["cert"], "--tls-key", ca["key"], "--token",
                     "tls-token=t", cpu_bytes="16MiB", nvme_bytes="64MiB",
                     client_kwargs={"root_ca": ca["ca"], "token": "tls-token"})
    try:
        tls: dict = {}
        with Client(f"grpcs://{d.address}", root_ca=ca["ca"], token="tls-token", timeout_s=5) as c:
            ns = c.register_namespace(Namespace(lay))
            hs = hashes(2, seed=61)
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            tls["with_ca_exact"] = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, c.get(ns, hs)))
            tls["transport"] = c.active_transport
        for name, kwargs in (("no_ca", {"url": f"grpcs://{d.address}"}), ("plaintext", {"url": d.address}),
                             ("wrong_ca", {"url": f"grpcs://{d.address}", "root_ca": make_test_ca(
                                 tempfile.mkdtemp(prefix="kvstore-ca2-", dir=workdir))["ca"]})):
            with Client(token="tls-token", timeout_s=3, **kwargs) as c:
                try:
                    c.stats()
                    tls[name] = "ACCEPTED"
                except KVStoreError as e:
                    tls[name] = type(e).__name__
        out["tls"] = tls
    finally:
        d.stop()
    return out

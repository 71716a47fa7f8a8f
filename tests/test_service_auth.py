"""Access control: bearer tokens -> tenants, tenant isolation, quotas, TLS."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import QuotaExceeded, Unauthenticated, UnknownNamespace

LAYOUT = KVLayout(model="test/auth", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return ChainHasher(seed=seed).chain(np.arange(16 * n), 16)


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def auth_daemon(tmp_path_factory):
    from daemon_util import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("auth"), "--token", "alice-secret=alice", "--token", "bob-secret=bob",
                     "--quota", "bob=64KiB")
    yield d
    d.kill()


def test_missing_or_wrong_token_is_unauthenticated(auth_daemon):
    for token in (None, "not-a-token"):
        with auth_daemon.client(token=token) as c:
            with pytest.raises(Unauthenticated):
                c.register_namespace(Namespace(LAYOUT))
            with pytest.raises(Unauthenticated):
                c.stats()
            assert c.health()  # standard health checks stay open for probes


def test_tenants_cannot_read_or_probe_each_other(auth_daemon):
    hashes = _chain(4, seed=1)
    blocks = _blocks(4, seed=1)
    with auth_daemon.client(token="alice-secret") as alice, auth_daemon.client(token="bob-secret") as bob:
        assert alice.active_transport == bob.active_transport == "shm"  # each maps only its own tenant segments
        ns_a = alice.register_namespace(Namespace(LAYOUT, tenant="bob"))  # a claimed tenant is ignored
        assert alice.stats()["server"]["tenant"] == "alice"
        assert alice.put(ns_a, hashes, blocks) == ["stored"] * 4
        ns_b = bob.register_namespace(Namespace(LAYOUT))
        assert ns_b != ns_a                                  # same layout, another tenant: another namespace
        assert bob.exists(ns_b, hashes) == [False] * 4       # the same hashes are not visible to bob
        assert bob.lookup(ns_b, hashes).num_hit == 0
        for call in (lambda: bob.lookup(ns_a, hashes), lambda: bob.exists(ns_a, hashes),
                     lambda: bob.get_into(ns_a, hashes, [np.empty(LAYOUT.block_bytes, np.uint8)] * 4),
                     lambda: bob.delete(ns_a, hashes)):
            with pytest.raises(UnknownNamespace):            # same answer as a namespace that does not exist
                call()
        assert alice.get(ns_a, hashes) == [b.tobytes() for b in blocks]


def test_quota_per_tenant(auth_daemon):
    with auth_daemon.client(token="bob-secret") as bob:
        ns = bob.register_namespace(Namespace(LAYOUT, cache_salt="quota"))
        hashes = _chain(6, seed=2)
        blocks = _blocks(6, seed=2)
        bob.put(ns, hashes[:3], blocks[:3])     # 3 x 16 KiB fits in 64 KiB
        with pytest.raises(QuotaExceeded, match="quota"):
            bob.put(ns, hashes[3:], blocks[3:])
        assert bob.exists(ns, hashes) == [True] * 3 + [False] * 3   # nothing already stored is lost
        assert bob.put(ns, hashes[:3], blocks[:3]) == ["exists"] * 3  # re-putting what is there is free


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test cert")
def test_tls(daemon_factory, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    d = daemon_factory("--tls-cert", str(cert), "--tls-key", str(key), client_kwargs={"root_ca": str(cert)})
    with d.client(transport="bulk") as c:
        assert c.health()
        assert c.active_transport == "grpc"   # no plaintext side channel beside a TLS endpoint
        ns = c.register_namespace(Namespace(LAYOUT))
        hashes, blocks = _chain(2, seed=3), _blocks(2, seed=3)
        c.put(ns, hashes, blocks)
        assert c.get(ns, hashes) == [b.tobytes() for b in blocks]
    with d.client(transport="grpc", timeout_s=2, root_ca=None) as plain:   # a plaintext client cannot talk to it
        assert not plain.health()

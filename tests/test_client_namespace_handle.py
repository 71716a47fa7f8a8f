"""kvstore.client.NamespaceHandle, the one daemon handle every connector uses, against real daemons:
it registers its namespace, turns a dead daemon into misses behind its circuit breaker, and works
again — namespace registered anew — once a daemon answers on the same address."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client import CircuitBreaker, NamespaceHandle
from kvstore.keys import ChainHasher, KVLayout, Namespace

LAYOUT = KVLayout(model="test/handle", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
N = 6


def blocks_for(hashes: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer((h * (LAYOUT.block_bytes // len(h) + 1))[:LAYOUT.block_bytes], dtype=np.uint8)
            for h in hashes]


@pytest.fixture
def chain() -> list[bytes]:
    return ChainHasher(seed=7).chain(np.arange(16 * N), 16)


def assert_round_trip(handle: NamespaceHandle, hashes: list[bytes]) -> None:
    assert handle.put(hashes, blocks_for(hashes)) is True
    assert handle.lookup(hashes).num_hit == len(hashes)
    assert handle.exists(hashes) == [True] * len(hashes)
    outs = [np.zeros(LAYOUT.block_bytes, dtype=np.uint8) for _ in hashes]
    assert handle.get_into(hashes, outs) == [LAYOUT.block_bytes] * len(hashes)
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks_for(hashes)))


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_daemon_killed_gives_misses_then_new_daemon_on_same_port_works(daemon_factory, chain, transport):
    first = daemon_factory()
    breaker = CircuitBreaker(failures_to_open=2, cool_down_s=1.0)
    handle = NamespaceHandle(Namespace(LAYOUT, cache_salt="handle"), url=first.url, timeout_s=1.0,
                             transport=transport, breaker=breaker, name="test handle")
    assert handle.register()
    assert_round_trip(handle, chain)
    assert handle.counters() == {"failures": 0, "skipped": 0}

    first.kill()
    outs = [np.full(LAYOUT.block_bytes, 9, dtype=np.uint8) for _ in chain]
    assert handle.lookup(chain).num_hit == 0                 # a miss, not an exception
    assert not breaker.is_open
    assert handle.get_into(chain, outs) == [None] * N        # the second failure opens the breaker
    assert breaker.is_open and handle.counters() == {"failures": 2, "skipped": 0}
    assert handle.put(chain, blocks_for(chain)) is False     # skipped while open: no timeout paid
    assert handle.exists(chain) == [False] * N
    assert handle.delete(chain) == 0
    assert handle.counters() == {"failures": 2, "skipped": 3}
    assert handle.health() is False

    second = daemon_factory("--listen", f"127.0.0.1:{first.port}")
    assert second.port == first.port
    assert handle.lookup(chain).num_hit == 0                 # still cooling down: skipped
    time.sleep(breaker.cool_down_s + 0.1)
    assert handle.lookup(chain).num_hit == 0                 # the new daemon is empty
    assert not breaker.is_open
    assert_round_trip(handle, chain)                         # registered anew on the new daemon
    with second.client() as c:
        assert c.exists(Namespace(LAYOUT, cache_salt="handle").id, chain) == [True] * N
    handle.close()


def test_daemon_restarted_between_calls_reregisters_without_a_miss(daemon_factory, chain):
    first = daemon_factory()
    handle = NamespaceHandle(Namespace(LAYOUT, cache_salt="restart"), url=first.url, timeout_s=5.0,
                             breaker=CircuitBreaker(failures_to_open=1, cool_down_s=30.0))
    assert_round_trip(handle, chain[:3])
    first.kill()
    second = daemon_factory("--listen", f"127.0.0.1:{first.port}")
    # The new daemon has never heard of the namespace: the handle registers it again and the
    # shm arena of the old run is dropped for the new one.
    assert_round_trip(handle, chain)
    assert handle.counters()["failures"] == 0
    assert second.alive()
    handle.close()


def test_breaker_opens_after_consecutive_failures_and_retries_after_cool_down():
    now = [0.0]
    b = CircuitBreaker(failures_to_open=3, cool_down_s=5.0, clock=lambda: now[0])
    assert b.allows()
    assert b.failed() is False and b.failed() is False
    b.succeeded()                                 # not consecutive any more
    assert b.failed() is False and b.failed() is False and b.failed() is True
    assert not b.allows()
    now[0] = 4.9
    assert not b.allows()
    now[0] = 5.0
    assert b.allows()                             # cool-down over: try again
    assert b.failed() is True and not b.allows()  # still failing: open again at once
    now[0] = 10.0
    b.succeeded()
    assert b.allows() and b.failed() is False


def test_handle_against_no_daemon_never_raises(chain):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handle = NamespaceHandle(Namespace(LAYOUT), url=f"127.0.0.1:{port}", timeout_s=0.3)
    assert handle.register() is False
    assert handle.lookup(chain).num_hit == 0
    assert handle.put(chain, blocks_for(chain)) is False
    assert handle.available() is False            # three failures: the default breaker opened
    assert handle.get_into(chain, [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in chain]) == [None] * N
    handle.close()


def test_a_lease_that_runs_out_is_a_miss_but_no_outage(daemon_factory, chain):
    """A daemon whose store leases run out before any copy can finish: every same-host put loses
    its lease (LeaseExpired, tried twice) and is a miss, yet the daemon answers, so the breaker
    stays closed and the next call is made, not skipped."""
    d = daemon_factory("--lease-seconds", "0.000001")
    breaker = CircuitBreaker(failures_to_open=1, cool_down_s=60.0)
    handle = NamespaceHandle(Namespace(LAYOUT, cache_salt="lease"), url=d.url, timeout_s=5.0,
                             breaker=breaker, name="test handle")
    assert handle.register()
    assert handle.client.active_transport == "shm"
    assert handle.put(chain, blocks_for(chain)) is False
    assert not breaker.is_open and handle.available()
    assert handle.counters() == {"failures": 1, "skipped": 0}
    assert handle.exists(chain) == [False] * N           # answered by the daemon, not skipped
    assert handle.counters() == {"failures": 1, "skipped": 0}

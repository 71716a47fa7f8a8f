"""``NamespaceHandle``: one namespace on one daemon, as every connector needs it — failing closed.

An engine must never fail a request because the cache is down, so connectors see the daemon
through this handle: it creates its ``Client`` lazily, registers the namespace on first use,
registers it again after a daemon restart (the daemon answers ``UnknownNamespace``, or the client
negotiated with another daemon run), and turns every failure into a miss — an empty lookup, no
blocks, ``False`` for a put — logged once per outage. A ``CircuitBreaker`` skips calls for a
cool-down after consecutive failures, so a dead daemon costs one timeout, not one per request.

    h = NamespaceHandle(namespace, url="127.0.0.1:7373", timeout_s=0.5)
    n = h.lookup(hashes).num_hit            # 0 when the daemon is down
    sizes = h.get_into(hashes, buffers)     # None per block: a miss
    ok = h.put(hashes, blocks, parent)      # False: not stored (recompute is fine)

The handle is safe to share between threads; several handles may share one ``Client`` (and one
breaker) by passing ``client=`` (then the caller closes that client).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.breaker import CircuitBreaker
from kvstore.client.sync_client import Client
from kvstore.errors import LeaseExpired, UnknownNamespace
from kvstore.keys import Namespace
from kvstore.wire import Lookup

logger = logging.getLogger("kvstore.client.namespace_handle")


class NamespaceHandle:
    def __init__(self, namespace: Namespace, *, url: str | None = None, token: str | None = None,
                 timeout_s: float = 5.0, transport: str = "auto", breaker: CircuitBreaker | None = None,
                 client: Client | None = None, name: str = "kvstore") -> None:
        self.namespace = namespace
        self.name = name
        self.breaker = breaker or CircuitBreaker()
        self.failures = 0            # calls that failed (each one a miss)
        self.skipped = 0             # calls not made while the breaker was open
        self._client_args = dict(url=url, token=token, timeout_s=timeout_s, transport=transport)
        self._client = client
        self._owns_client = client is None
        self._ns_id: bytes | None = None
        self._registered_on: str | None = None   # the daemon run that registered it (when known)
        self._in_outage = False
        self._lock = threading.Lock()

    # -- the client and the registration ---------------------------------------------------------

    @property
    def client(self) -> Client:
        """The Client calls go through (created on first use)."""
        with self._lock:
            if self._client is None:
                self._client = Client(**self._client_args)
            return self._client

    def use_client(self, client: Client) -> None:
        """Talk through ``client`` from now on (another address or connection): the namespace is
        registered anew and past failures are forgotten. Whoever owned the old client owns this one
        (the handle, unless it was built with ``client=``)."""
        with self._lock:
            old, self._client = self._client, client
            self._ns_id = None
        if old is not None and old is not client and self._owns_client:
            _close_quietly(old)
        self.breaker.reset()

    def available(self) -> bool:
        """False while the breaker skips calls (callers may skip preparing work for them)."""
        return self.breaker.allows()

    def register(self) -> bool:
        """Register the namespace now (else the first call does); False when the daemon is down."""
        return self.call(lambda client, ns_id: True, "register_namespace", default=False)

    def _namespace_id(self, client: Client) -> bytes:
        with self._lock:
            run = client.server_id
            if self._ns_id is None or (run is not None and self._registered_on not in (None, run)):
                self._ns_id = client.register_namespace(self.namespace)
                self._registered_on = client.server_id
            elif self._registered_on is None:
                self._registered_on = run
            return self._ns_id

    def _forget_registration(self) -> None:
        with self._lock:
            self._ns_id = None

    # -- calls -----------------------------------------------------------------------------------

    def call(self, fn: Callable[[Client, bytes], Any], what: str = "call", default: Any = None) -> Any:
        """``fn(client, namespace_id)``, or ``default`` when the daemon fails or the breaker is open.
        A daemon that forgot the namespace (it restarted) gets it registered again, once."""
        if not self.breaker.allows():
            self.skipped += 1
            return default
        try:
            client = self.client
            try:
                result = fn(client, self._namespace_id(client))
            except UnknownNamespace:
                self._forget_registration()
                result = fn(client, self._namespace_id(client))
        except LeaseExpired as e:
            # the daemon answered; this process copied past its lease (descheduled on a busy
            # host): a miss, but no outage, so later calls are not skipped
            self.failures += 1
            logger.warning("%s %s failed (%s: %s); the daemon answers, so calls go on", self.name, what,
                           type(e).__name__, e)
            return default
        except Exception as e:  # noqa: BLE001 - the boundary: a failure is a miss, never an engine error
            self._failed(what, e)
            return default
        self.breaker.succeeded()
        if self._in_outage:
            self._in_outage = False
            logger.info("%s: the daemon answers again", self.name)
        return result

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        self._forget_registration()  # a restarted daemon may not know the namespace
        opened = self.breaker.failed()
        if not self._in_outage:
            self._in_outage = True
            logger.warning("%s %s failed (%s: %s); treating failures as misses%s", self.name, what,
                           type(e).__name__, e,
                           f", skipping calls for {self.breaker.cool_down_s:.1f}s" if opened else "")
        else:
            logger.debug("%s %s failed again (%s: %s)", self.name, what, type(e).__name__, e)

    def counters(self) -> dict[str, int]:
        """Calls that failed and calls skipped while the breaker was open, since the last reset."""
        return {"failures": self.failures, "skipped": self.skipped}

    def reset_counters(self) -> None:
        self.failures = self.skipped = 0

    def lookup(self, hashes: Sequence[bytes], lease: bool = True, local_only: bool = False) -> Lookup:
        """Leading blocks present (pinned for the lease time; ``local_only``: the daemon's own, no
        fleet peer's); no hits when the daemon fails."""
        return self.call(lambda c, ns: c.lookup(ns, hashes, lease, local_only=local_only), "lookup",
                         default=Lookup(0, []))

    def exists(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.call(lambda c, ns: c.exists(ns, hashes), "exists", default=[False] * len(hashes))

    def get_into(self, hashes: Sequence[bytes], outs: Sequence,
                 byte_range: tuple[int, int] | None = None) -> list[int | None]:
        """Each block's size copied into ``outs[i]`` (only ``byte_range`` of it when given: see
        ``Client.get_into``), None for a miss (every block when the daemon fails; a buffer may then
        hold part of a block: use only those reported)."""
        return self.call(lambda c, ns: c.get_into(ns, hashes, outs, byte_range), "get", default=[None] * len(hashes))

    def put(self, hashes: Sequence[bytes], blocks: Sequence, parent: bytes | None = None) -> bool:
        """True when the daemon holds every block afterwards."""
        def store(client: Client, ns_id: bytes) -> bool:
            try:
                client.put(ns_id, hashes, blocks, parent=parent)  # raises unless every block is held
            except LeaseExpired:
                # a late lease: once more with a fresh one (the blocks already stored stay)
                client.put(ns_id, hashes, blocks, parent=parent)
            return True

        return self.call(store, "put", default=False)

    def delete(self, hashes: Sequence[bytes]) -> int:
        return self.call(lambda c, ns: c.delete(ns, hashes), "delete", default=0)

    def health(self) -> bool:
        """The daemon answers SERVING (never raises)."""
        try:
            return self.client.health()
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        """Close the client if this handle created it (a shared one belongs to its creator)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._owns_client:
            _close_quietly(client)


def _close_quietly(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a client of a dead daemon must not raise
        pass

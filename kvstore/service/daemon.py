"""The daemon process: tiers and Store from settings, the gRPC server, the lease reaper, shutdown.

Start-up refuses to run if hashing is not deterministic here (``determinism_self_check``): a
daemon that hashes differently from its clients would silently never hit. Shutdown on SIGTERM or
SIGINT: mark health NOT_SERVING, stop accepting, let in-flight RPCs finish (``grace_s``), flush
write-back blocks to NVMe, close the tiers, exit 0 — so a restart on the same NVMe directory
serves what the old daemon held. SIGHUP reloads the configuration (``reload.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable

from kvstore.service.heap import HeapTrimmer, limit_heap_arenas
from kvstore.service.auth import Authenticator
from kvstore.service.banner import RecoveryProgress, announced, banner_lines, redacted_url
from kvstore.service.config import ConfigError, Settings
from kvstore import dead_owners
from kvstore.errors import KVStoreError
from kvstore.keys import determinism_self_check
from kvstore.progress import Progress
from kvstore.service.gc_pauses import GcPauseCollector
from kvstore.service.http_endpoint import HttpEndpoint, RouteOverHttp
from kvstore.service.metrics import FleetCollector, Metrics, TenantCollector
from kvstore.service.reload import Reloader
from kvstore.service.grpc_server import build_server
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.transport import shm
from kvstore.units import format_size

log = logging.getLogger("kvstore.service.daemon")


#: the same-host probe files of a daemon, by its pid: those of daemons that died without closing
#: (SIGKILL, OOM) are swept at start; their arenas and sockets are swept by the CPU tier and the
#: socket servers as they start
_PROBE_NAME = re.compile(rf"^{re.escape(shm.PROBE_PREFIX)}(\d+)-")


def build_tiers(settings: Settings) -> list:
    """The tiers, fastest first. A tier that cannot be built closes those built before it (the CPU
    arena is a file in RAM-backed ``shm_dir``: left behind, it would hold that memory)."""
    tiers: list = []
    try:
        if settings.gpu_bytes:
            from kvstore.tiers.gpu import GpuTier
            tiers.append(GpuTier(settings.gpu_bytes, settings.cpu_slot_bytes, device=settings.gpu_device))
        with announced(f"cpu tier: allocating and touching its {format_size(settings.cpu_bytes, 'readable')} "
                       f"arena in {settings.shm_dir}"), \
                Progress("cpu tier: filling its arena", unit="bytes", say=log.info) as filling:   # seconds for GiBs
            tiers.append(CpuTier(settings.cpu_bytes, settings.cpu_slot_bytes, shm_dir=settings.shm_dir,
                                 segment_bytes=tenant_segment_bytes(settings) if settings.tokens else None,
                                 page_lock=bool(settings.gpu_bytes),   # no CUDA context without a GPU tier
                                 held_limit=settings.max_held_segment_bytes_per_tenant,
                                 on_filled=lambda done, total: filling.update(done, total=total)))
        if settings.nvme_bytes:
            from kvstore.tiers.nvme import NvmeTier
            tiers.append(NvmeTier(os.path.expanduser(settings.nvme_path), settings.nvme_bytes))
        if settings.redis_tier.enabled:
            tiers.append(build_redis_tier(settings))
    except BaseException:
        for tier in reversed(tiers):
            with contextlib.suppress(Exception):
                tier.close()
        raise
    return tiers


def tenant_segment_bytes(settings: Settings) -> int:
    """With auth on, the CPU arena is split into segments of one tenant each: many small segments
    waste less room per tenant, few large ones cost fewer descriptors and mappings."""
    slot = settings.cpu_slot_bytes
    wanted = settings.cpu_segment_bytes or min(max(settings.cpu_bytes // 64, slot), 256 * 1024 * 1024)
    return max(slot, wanted // slot * slot)


def build_redis_tier(settings: Settings):
    """The Redis tier below the local ones. A Redis that does not answer now is logged, not
    fatal: the tier's failures are counted misses and failed demotions, as disk trouble is."""
    from kvstore.tiers.redis import RedisTier
    r = settings.redis_tier
    fleet_secret = settings.fleet.secret if settings.fleet.enabled else None   # the pool's values are signed
    tier = RedisTier(r.capacity_bytes, r.connect_url, key_prefix=r.key_prefix, ttl_s=r.ttl_s,
                     max_block_bytes=settings.max_block_bytes, socket_timeout_s=r.socket_timeout_s,
                     secret=fleet_secret.get_secret_value().encode() if fleet_secret else None)
    try:
        tier.redis.ping()
    except Exception as e:  # noqa: BLE001 - any client failure: the tier degrades, the daemon serves
        log.warning("redis_tier: %s does not answer now (%s); blocks demoted there will be dropped until it does",
                    redacted_url(r.connect_url), type(e).__name__)
    return tier


class Daemon:
    """Everything one ``kvstore serve`` runs."""

    def __init__(self, settings: Settings, reload_settings: Callable[[], Settings]) -> None:
        """``reload_settings`` reads the configuration again (SIGHUP, ``kvstore reload``)."""
        determinism_self_check()
        # With tier codecs every demotion encodes: the kernels are compiled from start and the daemon
        # is NOT_SERVING until they are (``wait_ready``). Without, neither torch (~230 MiB of RSS)
        # nor the kernels (~150 MiB) are loaded until a lossy codec call arrives.
        self._warm = threading.Event()
        if not settings.tier_codecs:
            self._warm.set()
        self.settings = settings
        self._stop = threading.Event()
        self._tiers: list = []
        self.store = self.metrics = self.server = self.servicer = self.fleet = self.gc_pauses = self.http = None
        try:
            self._assemble(settings, reload_settings)
        except BaseException:
            self.abandon()
            raise

    def _assemble(self, settings: Settings, reload_settings: Callable[[], Settings]) -> None:
        dead_owners.sweep(settings.shm_dir, _PROBE_NAME)
        self._tiers = build_tiers(settings)
        opened = time.monotonic()
        log.info("opening the store: blocks a previous run left in the durable tiers are found again now")
        recovering = RecoveryProgress()
        try:
            self.store = Store(self._tiers, StoreConfig(
                eviction_policy=settings.eviction_policy, write_through=settings.write_through,
                promote_on_hit=settings.promote_on_hit, lease_seconds=settings.lease_seconds,
                tier_codecs=settings.tier_codecs, tenant_quotas=settings.quotas,
                max_block_bytes=settings.max_block_bytes, min_blocks_per_tier=4,
                max_namespaces_per_tenant=settings.max_namespaces_per_tenant),
                on_recovery=recovering)
        finally:
            recovering.close()
        self.open_s = time.monotonic() - opened   # the store built: after a restart, its blocks recovered
        self.store.admin.set_limits(settings.quotas, settings.pinned_bytes_limit, settings.max_leased_bytes_per_tenant)
        self.metrics = Metrics(self.store)
        auth = Authenticator(settings.tokens, settings.admin_tenants)
        self.server, self.servicer, self.port = build_server(self.store, settings, auth, self.metrics)
        self.http = HttpEndpoint(self.metrics.registry, RouteOverHttp(self.servicer))   # served with metrics_port
        self.metrics.registry.register(TenantCollector(self.store, self.servicer.usage, settings.metrics_top_n))
        self.gc_pauses = self.servicer.gc_pauses
        self.gc_pauses.install()
        self.metrics.registry.register(GcPauseCollector(self.gc_pauses))
        self.reloader = self.servicer.reloader = Reloader(settings, reload_settings, auth, self.store, self.metrics,
                                                          self.servicer.local_lookups.revoke)
        if settings.fleet.enabled:
            self.fleet = self._build_fleet(settings)   # refuses to start without fleet.secret
            self.servicer.fleet = self.fleet
            auth.peers = self.fleet.peer_verifier      # peers prove themselves, never send a token
            self.metrics.registry.register(FleetCollector(self.fleet))
        self.metrics_port: int | None = None

    def _build_fleet(self, settings: Settings):
        import socket

        from kvstore.fleet import Fleet
        f = settings.fleet
        pool = next((t for t in self.store.tiers if t.name == "redis"), None)   # the shared Redis tier, if any
        return Fleet(self.store, f.redis_url, f.node_id or socket.gethostname(), f.advertise_addr or self.address,
                     key_prefix=f.key_prefix, heartbeat_s=f.heartbeat_s, ttl_s=f.ttl_s, peer_fetch=f.peer_fetch,
                     peer_token=f.peer_token, peer_timeout_s=f.peer_timeout_s, secret=f.secret,
                     peer_tls_ca=f.peer_tls_ca, max_peer_clients=f.max_peer_clients, shared_pool=pool)

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def _compile_codecs(self) -> None:
        t0 = time.monotonic()
        try:
            from kvstore import codecs   # (torch, where installed: imported here, off the start-up path)
            if codecs.warm_up():
                log.info("codecs warmed up in %.1fs", time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - serve anyway: the codecs run their torch reference
            log.exception("codec warm-up failed; the codecs run their torch reference")
        finally:
            if not self._warm.is_set():   # (tier codecs: health said NOT_SERVING until now)
                self._warm.set()
                if not self._stop.is_set():
                    self.server.set_serving(True)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """True once the daemon is ready: with tier codecs, once their kernels are compiled; without,
        at once (a lossy codec call runs the torch reference until the kernels it starts are loaded)."""
        return self._warm.wait(timeout_s)

    def start(self) -> None:
        """Serve. A step that fails undoes every one before it (``abandon``) and raises."""
        try:
            if not self._warm.is_set():
                self.server.set_serving(False)
                threading.Thread(target=self._compile_codecs, name="kvstore-codec-warm-up", daemon=True).start()
            else:
                log.info("no tier codecs: torch and the codec kernels are loaded at the first lossy codec call")
            self.server.start()
            if self.fleet is not None:
                self.fleet.start()
            if self.settings.metrics_port is not None:
                self.metrics_port = self.http.serve(self.settings.metrics_host, self.settings.metrics_port)
            threading.Thread(target=self._reap, name="kvstore-lease-reaper", daemon=True).start()
        except BaseException:
            self.abandon()
            raise
        log.info("kvstore serving on %s (tiers: %s)", self.address, ", ".join(t.name for t in self.store.tiers))

    def _reap(self) -> None:
        """Release leases of clients that never came back (a killed client leaks nothing)."""
        period = min(1.0, max(0.05, self.store.config.lease_seconds / 4))
        heap = HeapTrimmer()  # a burst of large requests leaves freed heap in RSS until trimmed
        while not self._stop.wait(period):
            try:
                self.store.leases.expire()
                self.servicer.leases.client_leases.prune()
                self.servicer.stalls.cancel_stalled()
                shm.reap_probes(self.settings.shm_dir)
                heap.maybe_trim()
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad tick
                log.exception("lease reaper tick failed")

    def stop(self, grace_s: float = 10.0) -> int:
        """Graceful: refuse new work, finish in-flight RPCs, flush to NVMe. Returns blocks flushed."""
        if self._stop.is_set():
            return 0
        self.server.set_serving(False)
        if self.fleet is not None:
            self.fleet.close()  # withdraw first: peers stop routing here before we go
        self.server.stop(grace_s).wait()
        self._stop.set()
        self.servicer.close_transports()
        flushed = self.store.flush()
        self.store.leases.expire(now=float("inf"))
        self.http.close()
        self.store.close()
        self.gc_pauses.uninstall()
        log.info("kvstore stopped; %d blocks flushed to the durable tier", flushed)
        return flushed

    def abandon(self) -> None:
        """Undo a start that failed part-way: close whatever was built or started, so nothing it
        made outlives it (the arena file in RAM-backed ``shm_dir``, the service sockets there,
        the ports, the fleet's entries). Safe at any step; each part is closed on its own."""
        self._stop.set()
        parts = [self.http.close if self.http is not None else None,
                 self.fleet.close if self.fleet is not None else None,
                 (lambda: self.server.stop(0).wait(5)) if self.server is not None else None,
                 self.servicer.close_transports if self.servicer is not None else None,
                 self.store.close if self.store is not None else
                 lambda: [tier.close() for tier in reversed(self._tiers)],
                 self.gc_pauses.uninstall if self.gc_pauses is not None else None]
        for close in filter(None, parts):
            try:
                close()
            except Exception:  # noqa: BLE001 - the rest must still be closed
                log.exception("closing after a failed start")

    def ready_info(self) -> dict:
        arena = self.store.shared_arena()
        return {"address": self.address, "port": self.port, "metrics_port": self.metrics_port,
                "pid": os.getpid(), "arena_path": arena.path if arena else None,
                "tiers": [t.name for t in self.store.tiers]}


def write_ready_file(path: str, info: dict) -> None:
    """Write ``info`` to ``path`` whole or not at all: a reader never sees half of it, and a
    write that fails leaves neither the file nor its temporary behind."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run(settings: Settings, ready_file: str | None, reload_settings: Callable[[], Settings]) -> int:
    """Serve until SIGTERM/SIGINT (SIGHUP: reload); exit code 0 after a clean shutdown."""
    limit_heap_arenas()  # before the server's threads exist: lets a burst's freed heap be trimmed
    daemon = Daemon(settings, reload_settings)
    stop = threading.Event()
    reload_asked = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: reload_asked.set())   # handled below, off the signal frame
    daemon.start()
    try:
        while not daemon.wait_ready(0.2) and not stop.is_set():
            pass
        frozen = daemon.gc_pauses.freeze_startup_objects()
        log.info("%d objects made at start-up kept out of garbage collections", frozen)
        info = daemon.ready_info()
        if ready_file:
            write_ready_file(ready_file, info)
    except BaseException:
        daemon.abandon()
        raise
    print("\n".join(banner_lines(settings, info, daemon.store.stats()["tiers"], daemon.open_s)), flush=True)
    while not stop.wait(0.2):
        if reload_asked.is_set():
            reload_asked.clear()
            with contextlib.suppress(ConfigError):   # logged by the reloader; the running configuration stays
                daemon.reloader()
    t0 = time.monotonic()
    try:
        flushed = daemon.stop()
    except (KVStoreError, OSError) as e:  # e.g. the NVMe directory vanished: say so, not "cannot start"
        log.error("shutdown could not flush or close the tiers cleanly: %s", e)
        print(f"kvstore: stopped in {time.monotonic() - t0:.2f}s; flushing to the durable tier failed: {e}",
              flush=True)
        return 1
    print(f"kvstore: stopped in {time.monotonic() - t0:.2f}s; {flushed} blocks flushed", flush=True)
    return 0

"""What ``kvstore serve`` prints as it starts and once it serves: where it listens, what each tier
is, what it found, so an operator reading the first lines of its output need not open the config.
Steps of start-up that take seconds (filling the arena, recovering a durable tier) show their
progress while they run (``kvstore.progress``).
"""

from __future__ import annotations

import contextlib
import logging
import time

from kvstore.progress import Progress
from kvstore.service.config import Settings
from kvstore.store.policy import policy_name_for
from kvstore.units import format_size

log = logging.getLogger("kvstore.service.daemon")


@contextlib.contextmanager
def announced(what: str):
    """Log ``what`` before a step of start-up that may take seconds, and its time after it."""
    log.info("%s ...", what)
    t0 = time.monotonic()
    yield
    log.info("%s: done in %.1fs", what, time.monotonic() - t0)


class RecoveryProgress:
    """A warm restart's recovery as it runs (``Store``'s ``on_recovery``): for each durable tier
    the blocks found so far and blocks/s, then one line with the count and the time it took."""

    def __init__(self) -> None:
        self._tiers: dict[str, Progress] = {}

    def __call__(self, tier: str, found: int, done: bool) -> None:
        progress = self._tiers.get(tier)
        if progress is None:
            progress = self._tiers[tier] = Progress(f"{tier} tier: recovering", unit="blocks", say=log.info)
            progress.__enter__()
        progress.update(found)
        if not done:
            return
        progress.__exit__(None, None, None)
        log.info("%s tier: recovered %d blocks in %.2fs (%s)", tier, found, progress.elapsed_s, progress.rate())

    def close(self) -> None:
        """End any bar still shown (a recovery that failed)."""
        for progress in self._tiers.values():
            progress.__exit__(None, None, None)


def redacted_url(url: str) -> str:
    """A Redis URL without its user and password."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url.rpartition("@")[2]


def tier_place(settings: Settings, tier: str, arena_path: str | None) -> str:
    return {"cpu": arena_path or f"{settings.shm_dir} (one segment per tenant)", "nvme": settings.nvme_path,
            "gpu": settings.gpu_device, "redis": redacted_url(settings.redis_tier.connect_url)}.get(tier, "-")


def size_text(n: int) -> str:
    """``3.7 GiB (4000000000 bytes)``: the size as resolved, and exactly."""
    return f"{format_size(n, 'readable')} ({n} bytes)"


def banner_lines(settings: Settings, info: dict, tiers: dict[str, dict], start_s: float) -> list[str]:
    """The lines to print. ``info``: ``Daemon.ready_info()``; ``tiers``: the store's per-tier
    stats; ``start_s``: seconds the store took to open its tiers (recovery included)."""
    metrics = (f"metrics on {settings.metrics_host}:{info['metrics_port']}" if info.get("metrics_port")
               else "metrics off")
    auth = f"auth on ({len(set(settings.tokens.values()))} tenants)" if settings.tokens else "auth off"
    fleet = (f"fleet on ({redacted_url(settings.fleet.redis_url)})" if settings.fleet.enabled else "fleet off")
    lines = [f"kvstore: serving on {info['address']}, {metrics}, {auth}, {fleet}"]
    recovered = []
    for name, t in tiers.items():
        blocks = t.get("policy_blocks", t.get("blocks", 0))
        codec = (t.get("codec") or {}).get("configured", "raw")
        policy = policy_name_for(settings.eviction_policy, name)
        lines.append(f"  tier {name:5} {size_text(t.get('capacity_bytes', 0)):32} policy {policy:7} "
                     f"codec {codec:9} at {tier_place(settings, name, info.get('arena_path'))}")
        if blocks:
            recovered.append(f"{name} {blocks} blocks ({format_size(t.get('used_bytes', 0), 'readable')})")
    if recovered:
        lines.append(f"  warm restart: found {', '.join(recovered)} in {start_s:.2f}s")
    return lines

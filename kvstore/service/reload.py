"""Reload: re-read the configuration while serving (SIGHUP, ``kvstore reload``) and apply what
can change without a restart — tokens, admin tenants, quotas, the pin bound and the log level.

The new configuration is read exactly as at start (flags > environment > file > defaults) and
validated whole before anything changes: a bad value is refused with the key it concerns (never
a token: ``config._describe`` redacts them) and the running configuration stays as it was.
Turning authentication on or off is refused too: what the daemon offers its clients (the shared
arena) was decided at start. Changed settings that need a restart (tier sizes, listen address,
...) are reported and logged, not applied. Blocks and calls in flight are not touched; new
tokens count from the next call, and a removed or changed token is refused from its next call
on every transport (the tickets issued for it are revoked: ``transport.tickets``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.service.auth import Authenticator
from kvstore.service.config import ConfigError, Settings
from kvstore.service.metrics import Metrics
from kvstore.store import Store

log = logging.getLogger("kvstore.service.reload")

#: what a reload applies; any other changed setting needs a restart
RELOADABLE = ("tokens", "admin_tenants", "quotas", "max_pinned_bytes_per_tenant", "max_leased_bytes_per_tenant",
              "log_level")


class Reloader:
    """Call it to reload; returns ``(applied, ignored)`` setting names or raises ``ConfigError``."""

    def __init__(self, settings: Settings, load: Callable[[], Settings], auth: Authenticator, store: Store,
                 metrics: Metrics, revoke: Callable[[set[str]], None]) -> None:
        self.settings = settings     # what runs now
        self.load = load
        self.auth = auth
        self.store = store
        self.metrics = metrics
        self.revoke = revoke   # told the tenants that lost a token (``LocalLookupServer.revoke``)
        self._lock = threading.Lock()

    def __call__(self) -> tuple[list[str], list[str]]:
        with self._lock:
            try:
                new = self.load()
                if bool(new.tokens) != bool(self.settings.tokens):
                    raise ConfigError("invalid configuration:\n  tokens: a reload cannot turn authentication "
                                      f"{'on' if new.tokens else 'off'}; restart the daemon for that")
            except ConfigError as e:
                self.metrics.reloaded(False)
                log.error("reload refused; the running configuration is kept: %s", " ".join(str(e).split("\n  ")))
                raise
            old = self.settings
            named = old.model_fields_set | new.model_fields_set   # defaults computed at start (sizes) do not count
            changed = sorted(k for k in named if getattr(old, k) != getattr(new, k))
            applied = [k for k in changed if k in RELOADABLE]
            ignored = [k for k in changed if k not in RELOADABLE]
            # in force from now: the old settings with the reloadable keys new
            self.settings = running = old.model_copy(update={k: getattr(new, k) for k in RELOADABLE})
            if revoked := self.auth.replace(running.tokens, running.admin_tenants):
                self.revoke(revoked)
            self.store.admin.set_limits(running.quotas, running.pinned_bytes_limit,
                                        running.max_leased_bytes_per_tenant)
            logging.getLogger().setLevel(running.log_level)
            self.metrics.reloaded(True)
            log.info("reload: applied %s%s", ", ".join(applied) or "nothing (no change)",
                     f"; changed but need a restart, not applied: {', '.join(ignored)}" if ignored else "")
            return applied, ignored

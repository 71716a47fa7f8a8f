"""The store lock: one reentrant lock over the store's books (see ``cascade``), whose holder's
last release runs the tiers' deferred drop I/O with it released."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.tiers.base import Tier


class StoreLock:
    """The store lock: reentrant. A thread's last release of it finishes the tiers' drops (erasing
    dropped slots on disk, ``Tier.finish_drops``) with it released: drops happen under the lock,
    their I/O never does."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._lock = threading.RLock()
        self._held = threading.local()   # .depth: this thread's nesting
        self._finishing = [t for t in tiers if type(t).finish_drops is not Tier.finish_drops]

    def __enter__(self) -> None:
        self._lock.acquire()
        held = self._held
        held.depth = getattr(held, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        held = self._held
        held.depth -= 1
        self._lock.release()
        if held.depth == 0:
            for tier in self._finishing:
                tier.finish_drops()

"""A small circuit breaker: after N consecutive failures, stop calling for a cool-down.

A dead daemon should cost an engine one timeout, not one per request: once open, calls are
skipped (the caller treats them as misses) until the cool-down has passed; then calls go through
again, and the first success closes the breaker while another failure reopens it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failures_to_open: int = 3, cool_down_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures_to_open < 1:
            raise ValueError("failures_to_open must be at least 1")
        self.failures_to_open = failures_to_open
        self.cool_down_s = cool_down_s
        self._clock = clock
        self._consecutive = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped."""
        return self._clock() < self._open_until

    def allows(self) -> bool:
        """Whether a call may go to the daemon now."""
        return not self.is_open

    def succeeded(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._open_until = 0.0

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._consecutive >= self.failures_to_open:
                self._open_until = self._clock() + self.cool_down_s
                return True
            return False

    def reset(self) -> None:
        """Forget past failures (e.g. the caller now talks to another daemon)."""
        self.succeeded()

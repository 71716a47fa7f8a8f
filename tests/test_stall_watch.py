"""The stall watch cuts callers that stop, never a call the daemon itself is busy on.

A put the daemon is storing (a large batch onto NVMe, a wait for a deleted block's last reader)
makes no progress its peer can show; it used to be cut like a stalled client once that work took
longer than the bound (2 x lease_seconds). The watch's own sweeper runs here on a thread, as the
daemon's housekeeping thread runs it.
"""

from __future__ import annotations

import threading
import time

from kvstore.service.stalls import StallWatch

BOUND_S = 0.2


class _Sweeper:
    """Calls ``cancel_stalled`` every 20 ms, as the daemon's housekeeping does."""

    def __init__(self, watch: StallWatch) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(watch,), daemon=True)

    def _run(self, watch: StallWatch) -> None:
        while not self._stop.wait(0.02):
            watch.cancel_stalled()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_daemon_work_longer_than_the_bound_is_not_a_stall_but_silence_after_it_is():
    watch = StallWatch(BOUND_S)
    cut_at: list[float] = []
    with _Sweeper(watch), watch.watch(lambda: cut_at.append(time.monotonic())) as progress:
        with progress.working():
            time.sleep(4 * BOUND_S)           # the daemon stores a batch for four times the bound
        work_done = time.monotonic()
        assert not cut_at
        deadline = work_done + 25 * BOUND_S
        while not cut_at and time.monotonic() < deadline:
            time.sleep(0.01)                   # then the caller's silence is a stall
    assert len(cut_at) == 1 and watch.cancelled == 1
    assert cut_at[0] - work_done >= BOUND_S   # counted from the end of the work, not its start


def test_blocks_the_daemon_produces_slowly_are_its_work_and_sending_them_is_the_callers():
    watch = StallWatch(BOUND_S)
    cut = threading.Event()

    def slow_blocks():
        for i in range(3):
            time.sleep(2 * BOUND_S)           # e.g. each read from a slow disk
            yield i

    with _Sweeper(watch), watch.watch(cut.set) as progress:
        got = []
        for block in progress.working_through(slow_blocks()):
            got.append(block)
            progress.touch()                   # sent
        assert got == [0, 1, 2] and not cut.is_set()

    stalled = threading.Event()
    with _Sweeper(watch), watch.watch(stalled.set) as progress:
        for _ in progress.working_through(range(1)):
            time.sleep(5 * BOUND_S)           # the caller does not take what it was sent
        assert stalled.is_set()

"""fast_runner's thread limit: inside ``threads_at_most(1)`` a large block's work stays on the
caller's thread (bench_codecs.py's one-thread rows rely on it); outside, it is spread over
``BUDGET.codec`` threads."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.codecs import fast_runner
from kvstore.threads import BUDGET


def threads_used() -> set[int]:
    seen: set[int] = set()

    def job(a: int, b: int) -> int:
        seen.add(threading.get_ident())
        time.sleep(0.02)   # (long enough that a pool thread, however slow to wake, takes some pieces)
        return b - a
    assert fast_runner.run([(job, 64)], fast_runner.MIN_PARALLEL_ELEMENTS) == [64]
    return seen


def test_threads_at_most_one_keeps_the_work_on_the_callers_thread():
    with fast_runner.threads_at_most(1):
        assert threads_used() == {threading.get_ident()}


@pytest.mark.skipif(BUDGET.codec < 2, reason="one core: the runner never splits")
def test_without_a_limit_the_work_is_split_and_the_limit_is_restored():
    with fast_runner.threads_at_most(1):
        pass
    assert len(threads_used()) >= 2

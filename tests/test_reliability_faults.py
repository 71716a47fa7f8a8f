"""Disk faults and memory pressure against a real daemon: disk full, unwritable / read-only /
deleted NVMe directory, block files damaged under a running daemon, tiers larger than the
machine. Clear errors, the CPU tier keeps serving, counters report, never a wrong byte."""

from __future__ import annotations

import pytest

import reliability_runner as R


def _or_skip(fn, *args, **kwargs):
    try:
        return R.run(fn, *args, **kwargs)
    except R.Unsupported as e:
        pytest.skip(str(e))


def test_disk_full_degrades_to_cpu_and_recovers(tmp_path):
    r = _or_skip("disk_full", str(tmp_path))
    assert r["acknowledged_persisted"] > 0 and r["acknowledged_stored_only"] > 0, r  # the disk did fill
    assert r["lost"] == 0 and r["wrong"] == 0, r
    assert r["write_through_failures"] == r["acknowledged_stored_only"], r           # counted, not hidden
    assert r["recent_blocks_served_from_cpu"] == 8, r
    assert r["put_after_freeing"] == "persisted", r                                  # space back: durable again
    assert r["healthy"] and r["daemon_log_errors"] == 0, r


def test_unwritable_nvme_dir_is_refused_at_start_naming_the_path(tmp_path):
    r = R.run("unwritable_dir_at_start", str(tmp_path))
    for case, got in r.items():
        if "skipped" in got:
            continue
        assert got["refused"] and got["names_the_path"], (case, got)
        assert "nvme tier" in got["message"] and "not writable" in got["message"], got


def test_damaged_block_files_are_misses_never_wrong_bytes(tmp_path):
    r = R.run("corrupt_files_while_running", str(tmp_path))
    assert r["nvme_only"] >= r["damaged"] == 6, r
    assert r["damaged_served"] == 0 and r["wrong"] == 0 and r["intact_missing"] == 0, r
    assert r["corrupt_dropped_counter"] == 6 and r["corrupt_metric"] == 6, r           # Stats and Prometheus
    assert r["served_again_exact"] == 6 and r["healthy"] and r["daemon_log_errors"] == 0, r


@pytest.mark.parametrize("mode", ["deleted", "read_only"])
def test_nvme_dir_lost_while_running_cpu_keeps_serving(tmp_path, mode):
    r = _or_skip("dir_lost_while_running", str(tmp_path), mode)
    assert r["wrong"] == 0 and r["healthy"] and r["daemon_log_errors"] == 0, r
    assert r["puts_after_fault"] == ["stored"] * 8, r                                 # never claimed persisted
    assert r["write_through_failures"] == 8, r
    assert r["new_blocks_served"] == 8, r
    assert r["cpu_blocks_still_served"] == r["cpu_blocks_before_fault"] > 0, r
    if mode == "read_only":
        assert r["puts_after_recovery"] == ["persisted"] * 2 and r["sigterm_exit_code"] == 0, r
    else:
        assert r["sigterm_exit_code"] in (0, 1), r                                     # exits, reports, no hang


def test_tiers_larger_than_the_machine_are_refused_not_oom_killed(tmp_path):
    r = R.run("memory_refusals", str(tmp_path))
    for case, got in r.items():
        if "skipped" in got:
            continue
        assert got["refused"] and got["exit_code"] == 1 and not got["killed_by_signal"], (case, got)
        assert "cpu" in got["message"].lower() and "cannot start" in got["message"], got


def test_fully_pinned_arena_still_serves_blocks_from_nvme(tmp_path):
    r = R.run("pinned_arena", str(tmp_path))
    for transport, got in r.items():
        assert got["pinned_cpu_blocks"] == 4, (transport, got)
        assert got["served_exact"] == got["nvme_blocks_asked"] == 3, (transport, got)

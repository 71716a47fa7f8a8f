"""Driver jobs (JSON in, JSON out) run as real child processes: results in order, a failure raised
with its log's tail."""

from __future__ import annotations

import sys

import pytest

from kvstore.ops.engines import run_engine_jobs

DRIVER = """import json, sys
job = json.load(open(sys.argv[1]))
if job.get("fail"):
    print("driver gave up: " + job["fail"], flush=True)
    sys.exit(3)
json.dump({"twice": 2 * job["n"]}, open(sys.argv[2], "w"))
"""


def test_each_job_gets_its_result_in_order(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    assert run_engine_jobs(sys.executable, str(driver), tmp_path, [("a", {"n": 1}), ("b", {"n": 5})]) == [
        {"twice": 2}, {"twice": 10}]


def test_a_failed_job_raises_with_its_exit_status_and_log(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    with pytest.raises(RuntimeError, match=r"engine b exited with 3 \(log .*b\.log\):\ndriver gave up: no model"):
        run_engine_jobs(sys.executable, str(driver), tmp_path, [("a", {"n": 1}), ("b", {"fail": "no model"})])

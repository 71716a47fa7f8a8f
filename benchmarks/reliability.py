"""Reliability suite: kvstore under kill -9, disk faults, memory pressure, hostile input, tenants,
load and dependencies going down. Every scenario drives a REAL ``kvstore serve`` subprocess
(kvstore.ops.local_daemon) and returns a dict of counts; CI runs short versions
(tests/test_reliability_*.py), this script runs long ones and writes
benchmarks/results/reliability.{json,md}. The scenarios live in benchmarks/reliability_scenarios/,
one module per group; this entry script picks them, runs them and writes the results.

    .venv/bin/python benchmarks/reliability.py all            # the full suite (~15 min on 2 cores)
    .venv/bin/python benchmarks/reliability.py crash --kills 50
    .venv/bin/python benchmarks/reliability.py fuzz --requests 10000
    .venv/bin/python benchmarks/reliability.py load --clients 64 --seconds 30
    .venv/bin/python benchmarks/reliability.py segments_cycle --cycles 8
    .venv/bin/python benchmarks/reliability.py pin_starvation
    .venv/bin/python benchmarks/reliability.py all --quick    # the CI-sized versions

Run it with the interpreter that has kvstore installed (the project's .venv); it needs no path
set up (Python puts this script's folder, benchmarks/, first on the import path).

The promise being checked (docs/guarantees.md): never a wrong byte (every block's payload is
derived from its hash, so any byte served can be checked), never lose a block acknowledged as
"persisted", never hang or crash on bad input, never let one tenant see another's blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import grpc

from reliability_scenarios.churn import churn
from reliability_scenarios.common import KiB, MiB, Unsupported, hashes, is_exact, layout, payload
from reliability_scenarios.crash import crash_test
from reliability_scenarios.deps import daemon_killed_mid_request, redis_down
from reliability_scenarios.disk import (corrupt_files_while_running, dir_lost_while_running, disk_full, pinned_arena,
                                        unwritable_dir_at_start)
from reliability_scenarios.hostile import fuzz, slowloris
from reliability_scenarios.load import LOAD_OPS, load, run_load_worker
from reliability_scenarios.memory import memory_refusals
from reliability_scenarios.peer_replay import peer_replay
from reliability_scenarios.pins import pin_starvation
from reliability_scenarios.report import render_markdown
from reliability_scenarios.segment_memory import segments_cycle
from reliability_scenarios.tenancy import make_test_ca, tenancy
from reliability_scenarios.trust import http_slowloris, revocation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["KiB", "LOAD_OPS", "MiB", "SCENARIOS", "Unsupported", "churn", "corrupt_files_while_running", "crash_test",
           "daemon_killed_mid_request", "dir_lost_while_running", "disk_full", "fuzz", "hashes", "is_exact",
           "http_slowloris", "layout", "load", "machine", "main", "make_test_ca", "memory_refusals", "payload", "peer_replay",
           "pin_starvation", "pinned_arena", "redis_down", "render_markdown", "revocation", "run_scenario", "segments_cycle", "slowloris",
           "tenancy", "unwritable_dir_at_start"]


# -- driver ----------------------------------------------------------------------------------------

SCENARIOS = ("crash", "disk", "memory", "fuzz", "slowloris", "http_slowloris", "tenancy", "revocation", "peer_replay", "pin_starvation",
             "segments_cycle",
             "load", "deps", "churn")


def run_scenario(name: str, workdir: str, quick: bool, args) -> dict:
    t0 = time.monotonic()
    try:
        if name == "crash":
            r = crash_test(workdir, kills=10 if quick else args.kills)
        elif name == "disk":
            r = {}
            for sub, fn in (("disk_full", lambda: disk_full(workdir)),
                            ("unwritable_at_start", lambda: unwritable_dir_at_start(os.path.join(workdir, "unw"))),
                            ("corrupt_files", lambda: corrupt_files_while_running(workdir)),
                            ("pinned_arena", lambda: pinned_arena(workdir)),
                            ("dir_deleted", lambda: dir_lost_while_running(workdir, "deleted")),
                            ("read_only_remount", lambda: dir_lost_while_running(workdir, "read_only"))):
                try:
                    r[sub] = fn()
                except Unsupported as e:
                    r[sub] = {"skipped": str(e)}
        elif name == "memory":
            r = memory_refusals(workdir)
        elif name == "fuzz":
            r = fuzz(workdir, requests=300 if quick else args.requests)
        elif name == "slowloris":
            r = slowloris(workdir, stallers=10 if quick else 40)
        elif name == "http_slowloris":
            r = http_slowloris(workdir, clients=100, held_s=14.0)
        elif name == "tenancy":
            r = tenancy(workdir)
        elif name == "revocation":
            r = revocation(workdir)
        elif name == "peer_replay":
            r = peer_replay(workdir, rounds=1 if quick else 3)
        elif name == "pin_starvation":
            r = pin_starvation(workdir)
        elif name == "segments_cycle":
            r = {mode: segments_cycle(os.path.join(workdir, mode), cycles=3 if quick else args.cycles,
                                      cpu_bytes="16MiB" if quick else "64MiB", segment_bytes="1MiB" if quick else "4MiB",
                                      mode=mode) for mode in ("keep", "touch")}
        elif name == "load":
            r = load(workdir, clients=16 if quick else args.clients, seconds=3 if quick else args.seconds)
        elif name == "churn":
            r = churn(workdir, cycles=500 if quick else 10_000, hold_s=3.0 if quick else 30.0)
        elif name == "deps":
            r = {"daemon_killed_mid_request": daemon_killed_mid_request(workdir, rounds=1 if quick else 3)}
            try:
                r["redis_down"] = redis_down(workdir)
            except Unsupported as e:
                r["redis_down"] = {"skipped": str(e)}
        else:
            raise ValueError(name)
    except Unsupported as e:
        r = {"skipped": str(e)}
    r["wall_s"] = round(time.monotonic() - t0, 1)
    return r


CALLABLE = ("churn", "corrupt_files_while_running", "crash_test", "daemon_killed_mid_request", "dir_lost_while_running",
            "disk_full", "fuzz", "http_slowloris", "load", "memory_refusals", "pin_starvation", "pinned_arena", "redis_down", "revocation",
            "segments_cycle", "slowloris", "tenancy", "unwritable_dir_at_start")


def call_scenario(function: str, args: list, kwargs: dict, result_file: str) -> int:
    """Run one scenario function (JSON arguments) and write ``{"result": ...}`` (or ``{"unsupported": why}``) as
    JSON: tests/reliability_runner.py runs the scenarios through this, as a separate process,
    so tests/ never imports benchmarks/."""
    try:
        out = {"result": globals()[function](*args, **kwargs), "load_ops": list(LOAD_OPS)}
    except Unsupported as e:
        out = {"unsupported": str(e)}
    with open(result_file, "w") as f:
        json.dump(out, f, default=str)
    return 0


def machine() -> dict:
    import psutil

    return {"cpus": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "grpcio": grpc.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=SCENARIOS + ("all", "_load-worker", "_call"))
    p.add_argument("--quick", action="store_true", help="CI-sized runs")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--cycles", type=int, default=8, help="segments_cycle: arena fills per tenant")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--workdir", default=None)
    # load worker (internal)
    p.add_argument("--url")
    p.add_argument("--mode", default="sync")
    p.add_argument("--transport", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-bytes", type=int, default=64 * KiB)
    p.add_argument("--result-file")
    # _call (internal): run one scenario function with JSON keyword arguments, for the CI tests
    p.add_argument("--function", choices=CALLABLE)
    p.add_argument("--args", default="[]")
    p.add_argument("--kwargs", default="{}")
    args = p.parse_args(argv)
    if args.scenario == "_load-worker":
        run_load_worker(args)
        return 0
    if args.scenario == "_call":
        return call_scenario(args.function, json.loads(args.args), json.loads(args.kwargs), args.result_file)
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvstore-reliability-")
    path = os.path.join(args.out, "reliability.json")
    report = {"machine": machine(), "scenarios": {}}
    if os.path.exists(path) and args.scenario != "all":
        with open(path) as f:
            report = json.load(f)   # update one scenario in place
        report["machine"] = machine()
    for name in names:
        print(f"== {name}", flush=True)
        r = run_scenario(name, os.path.join(workdir, name), args.quick, args)
        r["quick"] = args.quick
        report["scenarios"][name] = r
        print(json.dumps(r, indent=1, default=str)[:3000], flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out, "reliability.md"), "w") as f:
            f.write(render_markdown(report))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

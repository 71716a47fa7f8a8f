"""Runs a reliability scenario of benchmarks/reliability.py in its own process and returns its
counts, so the CI-sized tests and the long benchmark share one implementation without tests/
importing benchmarks/ (the scenario drives real daemons either way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "reliability.py")


class Unsupported(Exception):
    """The scenario cannot run here (e.g. mounting is not permitted); the reason says why."""


def run(function: str, *args, **kwargs) -> dict:
    """The scenario's counts (what ``benchmarks/reliability.py`` records for it)."""
    return run_full(function, *args, **kwargs)["result"]


def run_full(function: str, *args, timeout_s: float = 280, **kwargs) -> dict:
    """``{"result": counts, "load_ops": the operations the load scenario mixes}``."""
    with tempfile.TemporaryDirectory(prefix="kvstore-rel-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        proc = subprocess.run([sys.executable, SCRIPT, "_call", "--function", function,
                               "--args", json.dumps(args), "--kwargs", json.dumps(kwargs), "--result-file", result_file],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(result_file):
            raise RuntimeError(f"{function} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(result_file) as f:
            out = json.load(f)
    if "unsupported" in out:
        raise Unsupported(out["unsupported"])
    return out

"""Run vllm_driver.py jobs in the vLLM venv from the main venv (tests and benchmarks share this).

    python = vllm_python()                      # KVSTORE_VENV_VLLM, else scripts/engine-venv.sh vllm
    results = run_jobs(python, workdir, [("name", job_dict), ...])   # in parallel; raises on failure
    result, stderr = run_script("vllm_chunk_loads.py", daemon_url)    # a tests/engines script, one JSON line
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Callable

from kvstore.ops.engines import run_engine_jobs, vllm_kv_transfer_config

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DRIVER = os.path.join(HERE, "vllm_driver.py")

from venvs import engine_venv  # noqa: E402,F401 - also used by benchmarks through this module


def vllm_python() -> str:
    return os.path.join(engine_venv("vllm"), "bin", "python")


def kvstore_transfer_config(url: str, **extra) -> dict:
    """kv_transfer_config for KVStoreConnector against the daemon at ``url``."""
    return vllm_kv_transfer_config(url, **extra)


def prompt_tokens(seed: int) -> Callable[[int], list[int]]:
    """``tokens(n)``: ``n`` random token ids in [3, 1000), the same sequence for the same ``seed``."""
    rng = random.Random(seed)
    return lambda n: [rng.randrange(3, 1000) for _ in range(n)]


def tiny_model(tmp_path_factory) -> dict:
    """The driver's build spec of the tiny random two-layer model (seed 0), in a directory of its own."""
    return {"out_dir": str(tmp_path_factory.mktemp("models") / "tiny"), "layers": 2, "seed": 0}


def run_jobs(python: str, workdir: str, jobs: list[tuple[str, dict]], timeout_s: float = 900) -> list[dict]:
    """Run each job in its own engine process, all at once; return their results in order."""
    return run_engine_jobs(python, DRIVER, workdir, jobs, timeout_s,
                           env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO})


def run_script(name: str, *args: str, timeout_s: float = 300) -> tuple[dict, str]:
    """Run tests/engines/``name`` in the vLLM venv; its last stdout line (JSON) and its stderr."""
    proc = subprocess.run([vllm_python(), os.path.join(HERE, name), *args], capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

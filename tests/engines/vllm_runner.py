"""Run vllm_driver.py jobs in the vLLM venv from the main venv (tests and benchmarks share this).

    python = vllm_python()                      # KVSTORE_VENV_VLLM, else scripts/engine-venv.sh vllm
    results = run_jobs(python, workdir, [("name", job_dict), ...])   # in parallel; raises on failure
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DRIVER = os.path.join(HERE, "vllm_driver.py")

from venvs import engine_venv  # noqa: E402,F401 - also used by benchmarks through this module


def vllm_python() -> str:
    return os.path.join(engine_venv("vllm"), "bin", "python")


def kvstore_transfer_config(url: str, **extra) -> dict:
    """kv_transfer_config for KVStoreConnector against the daemon at ``url``."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"url": url, **extra}}


def run_jobs(python: str, workdir: str, jobs: list[tuple[str, dict]], timeout_s: float = 900) -> list[dict]:
    """Run each job in its own engine process, all at once; return their results in order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    procs = []
    for name, job in jobs:
        base = os.path.join(str(workdir), name)
        with open(base + ".job.json", "w") as f:
            json.dump(job, f)
        log = open(base + ".log", "wb")
        procs.append((name, base, log, subprocess.Popen([python, DRIVER, base + ".job.json", base + ".result.json"],
                                                        stdout=log, stderr=subprocess.STDOUT, env=env,
                                                        cwd=str(workdir), start_new_session=True)))
    results = []
    for name, base, log, p in procs:
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the driver and its engine-core processes
            rc = p.wait()
        log.close()
        if rc != 0 or not os.path.exists(base + ".result.json"):
            with open(base + ".log", errors="replace") as f:
                tail = f.read()[-6000:]
            raise RuntimeError(f"engine {name} exited with {rc} (log {base}.log):\n{tail}")
        with open(base + ".result.json") as f:
            results.append(json.load(f))
    return results

"""Serving engines (vLLM, SGLang, LMCache) in their own venvs, driven from kvstore's venv.

Each engine pins versions that differ from ours, so tests and benchmarks run engine code in a
separate venv (built by a source checkout's ``scripts/engine-venv.sh``) as a child process. This
module is the one place that knows how: where an engine's venv is, the environment its child
runs in, and how to run a batch of driver jobs (JSON in, JSON out) in parallel.

    python = engine_python("vllm", build_script=os.path.join(repo, "scripts", "engine-venv.sh"))
    results = run_engine_jobs(python, driver_path, workdir, [("name", job_dict), ...])
"""

from __future__ import annotations

import json
import os
import signal
import subprocess


def engine_venv(engine: str, build_script: str | None = None) -> str:
    """The engine's venv: ``$KVSTORE_VENV_<ENGINE>`` (scripts/test.sh sets it), else what
    ``build_script ENGINE`` builds (or reuses) and prints last."""
    venv = os.environ.get(f"KVSTORE_VENV_{engine.upper()}")
    if not venv:
        if build_script is None:
            raise FileNotFoundError(f"no {engine} venv: set KVSTORE_VENV_{engine.upper()} "
                                    f"(a checkout builds one with scripts/engine-venv.sh {engine})")
        out = subprocess.run([build_script, engine], check=True, capture_output=True, text=True,
                             timeout=1800).stdout
        venv = out.strip().splitlines()[-1]
    if not os.path.isfile(os.path.join(venv, "bin", "python")):
        raise FileNotFoundError(f"no python in the {engine} venv ({venv})")
    return venv


def real_model_dir(build_script: str | None = None) -> str:
    """The real pretrained model's checkpoint directory (SmolLM2-135M-Instruct, bf16):
    ``$KVSTORE_REAL_MODEL`` (scripts/test.sh sets it), else what ``build_script`` (a checkout's
    ``scripts/real-model.sh``) builds (or reuses) and prints."""
    model = os.environ.get("KVSTORE_REAL_MODEL")
    if not model:
        if build_script is None:
            raise FileNotFoundError("no real model: set KVSTORE_REAL_MODEL (a checkout builds one with "
                                    "scripts/real-model.sh)")
        proc = subprocess.run([build_script], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{build_script} failed: {proc.stderr.strip().splitlines()[-1:]}")
        model = proc.stdout.strip().splitlines()[-1]
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"no config.json in the real model's directory ({model})")
    return model


def engine_python(engine: str, build_script: str | None = None) -> str:
    """The interpreter of the engine's venv (see ``engine_venv``)."""
    return os.path.join(engine_venv(engine, build_script), "bin", "python")


def engine_env() -> dict:
    """This process's environment without its KVSTORE_* and PYTHON* settings (the engine venv has
    its own interpreter and packages), with Python warnings silenced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON"))}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_engine_jobs(python: str, driver: str, workdir: str, jobs: list[tuple[str, dict]], timeout_s: float = 900,
                    env: dict | None = None) -> list[dict]:
    """Run ``python driver NAME.job.json NAME.result.json`` for each job, all at once, in its own
    process group under ``workdir``; return the results in order (raises with the log's tail when
    one fails). ``env`` is added to this process's environment less its KVSTORE_* settings."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env.update(env or {})
    procs = []
    for name, job in jobs:
        base = os.path.join(str(workdir), name)
        with open(base + ".job.json", "w") as f:
            json.dump(job, f)
        log = open(base + ".log", "wb")
        procs.append((name, base, log, subprocess.Popen([python, driver, base + ".job.json", base + ".result.json"],
                                                        stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                                        cwd=str(workdir), start_new_session=True)))
    results = []
    for name, base, log, p in procs:
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the driver and its engine-core processes
            rc = p.wait()
        log.close()
        results.append(job_result(base, rc, f"engine {name}"))
    return results


def job_result(base: str, rc: int, what: str, tail_chars: int = 6000) -> dict:
    """The result a driver that exited with ``rc`` wrote to ``BASE.result.json``; raises with the
    tail of ``BASE.log`` when it failed or wrote none."""
    if rc != 0 or not os.path.exists(base + ".result.json"):
        with open(base + ".log", errors="replace") as f:
            tail = f.read()[-tail_chars:]
        raise RuntimeError(f"{what} exited with {rc} (log {base}.log):\n{tail}")
    with open(base + ".result.json") as f:
        return json.load(f)


def vllm_kv_transfer_config(url: str, **extra) -> dict:
    """vLLM's ``kv_transfer_config`` for kvstore's connector against the daemon at ``url``."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"url": url, **extra}}

"""Engine venvs (vLLM, SGLang, LMCache) for the tests and benchmarks that drive engines in them.

    venv = engine_venv("sglang")     # $KVSTORE_VENV_SGLANG (scripts/test.sh sets it), else build/reuse it
    subprocess.run([os.path.join(venv, "bin", "python"), driver], env=engine_env())
"""

from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_venv(engine: str) -> str:
    """The engine's venv: ``$KVSTORE_VENV_<ENGINE>``, else scripts/engine-venv.sh builds (or reuses) it."""
    venv = os.environ.get(f"KVSTORE_VENV_{engine.upper()}")
    if not venv:
        out = subprocess.run([os.path.join(REPO, "scripts", "engine-venv.sh"), engine], check=True,
                             capture_output=True, text=True, timeout=1800).stdout
        venv = out.strip().splitlines()[-1]
    if not os.path.isfile(os.path.join(venv, "bin", "python")):
        raise FileNotFoundError(f"no python in the {engine} venv ({venv})")
    return venv


def engine_env() -> dict:
    """This process's environment without its KVSTORE_* and PYTHON* settings (the engine venv has
    its own interpreter and packages), with Python warnings silenced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON"))}
    env["PYTHONWARNINGS"] = "ignore"
    return env

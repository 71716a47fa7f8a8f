"""Engine venvs (vLLM, SGLang, LMCache) and the real model for the tests: kvstore.ops.engines with this
checkout's builders.

    venv = engine_venv("sglang")     # $KVSTORE_VENV_SGLANG (scripts/test.sh sets it), else build/reuse it
    model = real_model()             # $KVSTORE_REAL_MODEL (scripts/test.sh sets it), else scripts/real-model.sh
    subprocess.run([os.path.join(venv, "bin", "python"), driver], env=engine_env())
"""

from __future__ import annotations

import os

from kvstore.ops import engines
from kvstore.ops.engines import engine_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_SCRIPT = os.path.join(REPO, "scripts", "engine-venv.sh")
MODEL_SCRIPT = os.path.join(REPO, "scripts", "real-model.sh")

__all__ = ["engine_env", "engine_venv", "real_model"]


def engine_venv(engine: str) -> str:
    """The engine's venv: ``$KVSTORE_VENV_<ENGINE>``, else scripts/engine-venv.sh builds (or reuses) it."""
    return engines.engine_venv(engine, build_script=BUILD_SCRIPT)


def real_model() -> str:
    """The real model's checkpoint directory: ``$KVSTORE_REAL_MODEL``, else scripts/real-model.sh
    builds (or reuses) it."""
    return engines.real_model_dir(build_script=MODEL_SCRIPT)

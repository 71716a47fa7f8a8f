"""kvstore's SGLang HiCache backend, driven by SGLang's real storage code on CPU.

SGLang runs in its own venv; tests/engines/sglang_hicache.py builds SGLang's host pools (MHA in
all four layouts, MLA), loads the backend through SGLang's dynamic backend factory, runs
SGLang's HiCacheController backup and prefetch threads, and wraps the backend in SGLang's
failure injector — all against a real kvstore daemon. The driver runs once per module; each
test below asserts one of its checks.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from venvs import engine_venv  # tests/engines (on sys.path via conftest)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = [
    "roundtrip_mha_layer_first", "roundtrip_mha_page_first", "roundtrip_mha_page_first_direct",
    "roundtrip_mha_page_head", "roundtrip_mla_layer_first", "roundtrip_mla_page_first",
    "roundtrip_mla_page_first_direct", "codecs_mha_layer_first", "codecs_mha_page_first",
    "codecs_mha_page_first_direct", "codecs_mha_page_head", "codecs_mla_layer_first", "codecs_mla_page_first",
    "codecs_mla_page_first_direct", "layout_mismatch", "unsupported_layout", "mla_one_writer", "daemon_down",
    "failure_injector", "concurrent_threads", "controller",
]


@pytest.fixture(scope="module")
def sglang_checks(kv_daemon) -> dict:
    python = os.path.join(engine_venv("sglang"), "bin", "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON", "SGLANG_"))}
    proc = subprocess.run([python, os.path.join(REPO, "tests", "engines", "sglang_hicache.py"),
                           "--url", kv_daemon.url], capture_output=True, text=True, timeout=900, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)  # the first test also runs the driver (SGLang imports slowly on 2 cores)
@pytest.mark.parametrize("check", CHECKS)
def test_sglang_hicache(sglang_checks, check):
    assert check in sglang_checks, f"driver did not run {check}"
    result = sglang_checks[check]
    assert result["ok"], result["detail"]

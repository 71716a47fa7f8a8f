"""The ``kvstore`` console script as a user runs it: a non-editable install, started from the repo root.

From the root of a source checkout the working directory holds a ``kvstore/`` folder that is not
the installed package (the install maps ``tiers/``, ``proto/`` and ``connectors/`` into it). Any
child process that puts the cwd on ``sys.path`` imports that folder and dies with
``ModuleNotFoundError: kvstore.proto``; anything that reaches for ``benchmarks/`` finds nothing.
The fixture lays out what ``pip install .`` installs (per pyproject.toml's package mapping) in a
throw-away venv whose other packages come from this one, without this venv's editable-install
hook, and writes the console script the way pip would.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed_kvstore(tmp_path_factory) -> str:
    """Path of a ``kvstore`` console script backed by a plain (non-editable) copy of the package."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, source in sorted(package_dirs.items(), key=lambda item: item[0].count(".")):
        shutil.copytree(os.path.join(REPO, source), os.path.join(purelib, *package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    # dependencies from this interpreter; a path named in a .pth file is added without running the
    # .pth files inside it, so this venv's editable-install finder stays out
    dependency_dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    with open(os.path.join(purelib, "dependencies.pth"), "w") as f:
        f.write("\n".join(sorted(dependency_dirs)) + "\n")
    script = venv / "bin" / "kvstore"
    script.write_text(f"#!{python}\nimport sys\nfrom kvstore.ops.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    probe = subprocess.run([str(python), "-c", "import kvstore.proto, kvstore.tiers; print(kvstore.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    assert probe.returncode == 0 and probe.stdout.startswith(purelib), probe.stderr
    return str(script)


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON"))}


def test_bench_without_url_from_the_repo_root(installed_kvstore):
    r = subprocess.run([installed_kvstore, "bench", "--sizes", "64KiB", "--total", "1MiB", "--transports",
                        "grpc,shm", "--json"], capture_output=True, text=True, timeout=180, cwd=REPO,
                       env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["daemon"] == "private child process"
    row = report["sizes"][str(64 << 10)]
    assert row["grpc"]["verified"] and row["shm"]["verified"]
    assert report["lookups"]["sequential_per_s"] > 0


def test_plan_measures_this_host_when_installed(installed_kvstore, tmp_path):
    out = tmp_path / "plan"
    r = subprocess.run([installed_kvstore, "plan", "--model", "llama3-8b", "--block-tokens", "16", "--workload",
                        "chat:turns=2,rate=4", "--requests", "20", "--cpu", "64MiB", "--jobs", "1", "--quiet",
                        "--measure-dir", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=REPO, env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["cost_model"]["bandwidth_source"].startswith("measured on this host")
    assert report["machine"]["cores"] == os.cpu_count()


USER_SCRIPT = """
import sys
import numpy as np
import kvstore
from kvstore import Client, ChainHasher, KVLayout, Namespace
layout = KVLayout("my-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
with Client(sys.argv[1]) as c:
    ns = c.register_namespace(Namespace(layout))
    hashes = ChainHasher().chain(list(range(32)), 16)
    blocks = [np.full(layout.block_bytes, i, np.uint8) for i in range(2)]
    assert c.put(ns, hashes, blocks) == ["stored", "stored"]
    assert c.get(ns, hashes) == [b.tobytes() for b in blocks]
print(kvstore.__file__)
"""


def test_a_user_script_runs_from_the_repo_root_with_a_plain_install(installed_kvstore, daemon_factory, tmp_path):
    """README's "your own code" as a user runs it: a script in the checkout's root, run there with
    the interpreter of a plain (make serve) install. Python puts the root first on sys.path, so the
    checkout's kvstore/ is what it imports; it must import whole (tiers/, proto/ beside it)."""
    d = daemon_factory()
    script = os.path.join(REPO, f"user_script_{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(USER_SCRIPT)
    try:
        python = os.path.join(os.path.dirname(installed_kvstore), "python")
        r = subprocess.run([python, os.path.basename(script), d.address], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env=_clean_env())
    finally:
        os.unlink(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == os.path.join(REPO, "kvstore", "__init__.py")   # the checkout's, imported whole

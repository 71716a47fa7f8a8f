"""The core install (``make serve``'s: no torch, no numba) with codec settings, run for real.

A ``sitecustomize`` on the child's PYTHONPATH makes ``torch`` and ``numba`` unimportable, as they
are in a venv built by ``pip install .``; the daemon and ``kvstore plan`` run as the real CLI in a
subprocess. zstd (lossless; ``zstandard`` is a core dependency) must work; the lossy codecs must
be refused at start in one line naming the extra to install, never with a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.keys import ChainHasher, KVLayout, Namespace

BLOCKER = '''
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numba"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Missing())
'''


CLIENT_WITHOUT_TORCH = """
import sys
import numpy as np
from kvstore.client import Client
from kvstore.keys import ChainHasher, KVLayout, Namespace
assert "torch" not in sys.modules
layout = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
blocks = [np.repeat(np.arange(layout.block_bytes // 64, dtype=np.uint8), 64) + i for i in range(4)]
with Client(sys.argv[1], transport="grpc") as c:
    ns = c.register_namespace(Namespace(layout))
    hashes = ChainHasher().chain(np.arange(4 * 16), 16)
    got = c.get(ns, hashes)
    stored = c.get_payloads(ns, hashes)
from kvstore import codecs
decoded = [codecs.decode_block(codec, payload, layout) for codec, payload in stored]
print(sorted({codec for codec, _ in stored}), len(got),
      all(bytes(b) == g == d.tobytes() for b, g, d in zip(blocks, got, decoded)) and "torch" not in sys.modules)
"""


@pytest.fixture
def no_torch_env(tmp_path) -> dict:
    site = tmp_path / "no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": str(site)}


def _serve(tmp_path, env, *flags) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHONPATH"))} | env
    return subprocess.run([sys.executable, "-P", "-m", "kvstore.ops.cli", "serve", "--listen", "127.0.0.1:0",
                           "--cpu-bytes", "32MiB", "--nvme-bytes", "64MiB", "--nvme-path", str(tmp_path / "nvme"),
                           *flags], capture_output=True, text=True, env=child_env, cwd=tmp_path, timeout=120)


def test_zstd_tier_serves_without_torch(tmp_path, no_torch_env):
    config = tmp_path / "kv.yaml"
    config.write_text("codecs:\n  cpu: zstd\n")
    d = start_daemon(tmp_path / "d", "--config", str(config), env=no_torch_env, cpu_bytes="32MiB",
                     nvme_bytes="64MiB")
    try:
        with open(f"/proc/{d.pid}/maps") as f:
            assert "libtorch" not in f.read()   # the daemon really runs without torch
        layout = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
        blocks = [np.repeat(np.arange(layout.block_bytes // 64, dtype=np.uint8), 64) + i for i in range(4)]
        with d.client(transport="grpc") as c:
            ns = c.register_namespace(Namespace(layout))
            hashes = ChainHasher().chain(np.arange(4 * 16), 16)
            assert c.put(ns, hashes, blocks) == ["stored"] * 4
            got = c.get(ns, hashes)
            cpu = c.stats()["tiers"]["cpu"]
        assert [bytes(b) for b in blocks] == got
        assert cpu["codec"]["configured"] == "zstd" and cpu["codec"]["held_encoded_blocks"] == 4
        # a client without torch either: it asks for the zstd payloads as stored and decodes them itself
        reader = subprocess.run([sys.executable, "-P", "-c", CLIENT_WITHOUT_TORCH, d.address], capture_output=True,
                                text=True, timeout=120, env={**os.environ, **no_torch_env}, cwd=tmp_path)
        assert reader.returncode == 0 and reader.stdout.split() == ["[6]", "4", "True"], reader.stderr
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("config, setting", [("codecs:\n  nvme: fp8\n", "codecs.nvme"),
                                             ("redis_tier:\n  enabled: true\n  codec: int4_g64\n",
                                              "redis_tier.codec")])
def test_lossy_codec_without_torch_is_refused_in_one_line(tmp_path, no_torch_env, config, setting):
    (tmp_path / "kv.yaml").write_text(config)
    r = _serve(tmp_path, no_torch_env, "--config", str(tmp_path / "kv.yaml"))
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if "WARNING" not in line]
    assert len(lines) == 1, r.stderr
    assert setting in lines[0] and "pip install 'kvstore[codecs]'" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_plan_with_a_lossy_codec_without_torch_is_refused_in_one_line(tmp_path, no_torch_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONPATH")} | no_torch_env
    r = subprocess.run([sys.executable, "-P", "-m", "kvstore.ops.cli", "plan", "--model", "llama3-8b",
                        "--workload", "chat", "--requests", "50", "--codec", "raw,fp8", "--bandwidth",
                        "cpu=19,nvme=3", "--out", str(tmp_path / "plan")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "fp8" in r.stderr and "kvstore[codecs]" in r.stderr, r.stderr

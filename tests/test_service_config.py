"""Settings: precedence (flags > env > file > defaults), units, validation messages; the
checked-in gRPC stubs match the .proto; `kvstore serve` refuses a bad config naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.service.config import ConfigError, load_settings
from kvstore.units import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("KVSTORE_"):
            monkeypatch.delenv(key)


def test_sizes_accept_units():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(" 64 kib ") == 64 << 10
    assert parse_size(4096) == 4096
    for bad in ("12 parsecs", "GiB", "-1GiB", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    yaml_file = tmp_path / "kv.yaml"
    yaml_file.write_text("cpu_bytes: 512MiB\nlease_seconds: 2\nnvme_bytes: 1GiB\nfleet:\n  enabled: true\n")
    defaults = load_settings()
    assert defaults.lease_seconds == 5.0 and defaults.listen == "127.0.0.1:7373" and defaults.gpu_bytes == 0
    assert 64 << 20 <= defaults.cpu_bytes <= 4 << 30
    from_file = load_settings(str(yaml_file))
    assert (from_file.cpu_bytes, from_file.lease_seconds, from_file.fleet.enabled) == (512 << 20, 2.0, True)
    monkeypatch.setenv("KVSTORE_LEASE_SECONDS", "3")
    monkeypatch.setenv("KVSTORE_CPU_BYTES", "256MiB")
    monkeypatch.setenv("KVSTORE_FLEET__REDIS_URL", "redis://10.0.0.1:6379/0")
    env = load_settings(str(yaml_file))
    assert (env.cpu_bytes, env.lease_seconds, env.nvme_bytes) == (256 << 20, 3.0, 1 << 30)
    assert env.fleet.redis_url == "redis://10.0.0.1:6379/0" and env.fleet.enabled is True
    flags = load_settings(str(yaml_file), cpu_bytes="1GiB", lease_seconds=None)
    assert (flags.cpu_bytes, flags.lease_seconds) == (1 << 30, 3.0)  # None flag = not given


def test_toml_file_and_config_env(tmp_path, monkeypatch):
    toml_file = tmp_path / "kv.toml"
    toml_file.write_text('listen = "0.0.0.0:9000"\nwrite_through = true\n[tokens]\nsecret = "team-a"\n'
                         '[quotas]\nteam-a = "2GiB"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(toml_file))
    s = load_settings()
    assert s.listen == "0.0.0.0:9000" and s.port == 9000 and s.write_through
    assert s.tokens == {"secret": "team-a"} and s.quotas == {"team-a": 2 << 30}


@pytest.mark.parametrize("flags, key, hint", [
    ({"cpu_bytes": "12 parsecs"}, "cpu_bytes", "unit"),
    ({"cpu_bytes": 10}, "cpu_bytes", ">= 1MiB"),
    ({"lease_seconds": 0}, "lease_seconds", "> 0"),
    ({"listen": "nowhere"}, "listen", "HOST:PORT"),
    ({"eviction_policy": "fifo"}, "eviction_policy", "lru"),
    ({"metrics_port": 70000}, "metrics_port", "<= 65535"),
    ({"chunk_bytes": "1GiB"}, "chunk_bytes", "<= 8MiB"),
    ({"tls_cert": "/x.pem"}, "tls_key", "together"),
])
def test_bad_values_name_the_key_and_range(flags, key, hint):
    with pytest.raises(ConfigError) as e:
        load_settings(**flags)
    assert key in str(e.value) and hint in str(e.value)


def test_unknown_key_and_bad_file(tmp_path):
    f = tmp_path / "kv.yaml"
    f.write_text("cpu_byte: 1GiB\n")
    with pytest.raises(ConfigError, match="cpu_byte: unknown setting"):
        load_settings(str(f))
    f.write_text("cpu_bytes: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_settings(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(str(tmp_path / "missing.yaml"))


def test_serve_refuses_bad_config_naming_the_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "serve", "--cpu-bytes", "lots", "--listen",
                        "127.0.0.1:0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert "cpu_bytes" in r.stderr and "unit" in r.stderr


def test_generated_stubs_are_current():
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gen_proto.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_declared_dependencies_match_what_the_stubs_check_at_import():
    """The generated stubs refuse, at import, a grpcio older than the generator and a protobuf
    runtime older than its protoc, so pyproject's floors must be those very versions, and the
    generator is pinned to the one that wrote them (a newer grpcio-tools rewrites the version
    stamp, and the check above would call the checked-in stubs stale); the engine venvs' own
    requirement files, which install kvstore without its dependencies, say the same floors."""
    import re
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["test"]
    grpc_source = open(os.path.join(REPO, "proto", "kvstore_pb2_grpc.py")).read()
    grpc_stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_source).group(1)
    pb2_source = open(os.path.join(REPO, "proto", "kvstore_pb2.py")).read()
    pb_stamp = re.search(r"# Protobuf Python Version: ([0-9.]+)", pb2_source).group(1)
    assert f"grpcio>={grpc_stamp}" in deps
    assert f"grpcio-tools=={grpc_stamp}" in deps
    assert any(d.startswith(f"protobuf>={pb_stamp}") for d in deps), deps
    # the engine venvs install kvstore without its dependencies: their own lists must say the same
    ours = {re.split(r"[<>=]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    requirements = os.path.join(REPO, "connectors", "requirements")
    for name in sorted(os.listdir(requirements)):
        if name.endswith(".txt"):
            for line in open(os.path.join(requirements, name)).read().splitlines():
                pkg = re.split(r"[<>=\[ ]", line.strip(), maxsplit=1)[0]
                if pkg in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"):
                    assert line.strip() == ours[pkg], (name, line)


def test_stub_imports_its_messages_from_the_package():
    import kvstore.proto.kvstore_pb2_grpc as grpc_stub
    source = open(grpc_stub.__file__).read()
    assert "from kvstore.proto import kvstore_pb2" in source


def test_unknown_setting_is_refused_by_name_without_echoing_tokens():
    """A key that is no setting (here ``shm_with_auth``: with tokens set, same-host clients always
    get tenant segments, tests/test_trust_shm_tenants.py) is refused by name, and the error names
    no token."""
    for value in (True, False):
        with pytest.raises(ConfigError, match="shm_with_auth: unknown setting") as e:
            load_settings(tokens={"tok-alice-secret": "alice", "tok-bob-secret": "bob"}, shm_with_auth=value)
        assert "tok-alice-secret" not in str(e.value) and "tok-bob-secret" not in str(e.value)


def test_hash_settings_that_did_nothing_are_gone():
    """The daemon never hashes tokens itself (clients send block hashes); a setting that does
    nothing is refused as unknown rather than silently accepted."""
    with pytest.raises(ConfigError, match="hash_seed: unknown setting"):
        load_settings(hash_seed=3)

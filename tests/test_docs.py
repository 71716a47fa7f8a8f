"""Every shell and Python block in README.md and docs/ runs as a user would run it, and those that
cannot run here say why (tests/docs_blocks.py: how blocks are read and marked).

One session per document: its own directory, the venv's ``kvstore`` and ``python`` on PATH, a real
daemon wherever the document starts one (on free ports: the docs' 7373 and 9464 are swapped for
them, and their /tmp/ops paths for the session directory), the real Redis for the Redis tier and
the fleet. A command fails the test when it exits other than the docs show (``exit N``, else 0) or
prints a traceback; a Python block, when it fails; a config, when ``kvstore serve`` would refuse it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from docs_blocks import Block, blocks_of, commands_of, documents

VENV_BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Session:
    """One document's directory, environment, address substitutions and background daemon."""

    def __init__(self, workdir) -> None:
        self.dir = str(workdir)
        os.makedirs(self.dir, exist_ok=True)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for name in os.listdir(repo):   # commands name scripts/, deploy/ ... as from the repository root
            if not name.startswith("."):
                os.symlink(os.path.join(repo, name), os.path.join(self.dir, name))
        grpc_port, metrics_port, tag = free_port(), free_port(), uuid.uuid4().hex[:8]
        self.swaps = [("7373", str(grpc_port)), ("7390", str(grpc_port)), ("9464", str(metrics_port)),
                      ("/tmp/ops", os.path.join(self.dir, "ops")), ("kvdemo", f"kvdocs{tag}")]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHONPATH"))}
        self.env.update({"PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""), "COLUMNS": "80",
                         "XDG_CACHE_HOME": os.path.join(self.dir, "cache")})
        self.daemon: subprocess.Popen | None = None
        self.ran = 0

    def swap(self, text: str) -> str:
        for old, new in self.swaps:
            text = text.replace(old, new)
        return text

    def write(self, name: str, text: str) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(self.swap(text) + "\n")

    def run(self, block: Block) -> None:
        kind, arg = block.kind()
        if kind in ("skip", "output"):
            return
        self.ran += 1
        if block.marker == "daemon" and (self.daemon is None or self.daemon.poll() is not None):
            self.serve(block, "kvstore serve --listen 127.0.0.1:7373 --cpu-bytes 64MiB --nvme-bytes 0")
        if kind == "file":
            self.write(arg, block.text)
        elif kind == "yaml":
            yaml.safe_load(block.text)
        elif kind == "config":
            self.check_config(block)
        elif kind == "python":
            name = f"block_{block.line}.py"
            self.write(name, block.text)
            self.shell(block, f"python {name}", None)
        elif kind == "commands":
            for command in commands_of(block):
                if re.match(r"^(\S+=\S+ )*kvstore serve\b", command.text):
                    self.serve(block, command.text)
                else:
                    self.shell(block, command.text, command.expected_exit)
        else:
            pytest.fail(f"{block.where}: a {block.lang or 'plain'} block that is neither run nor marked")

    def check_config(self, block: Block) -> None:
        from kvstore.service.config import load_settings

        path = os.path.join(self.dir, f"config_{block.line}.yaml")
        self.write(os.path.basename(path), block.text)
        load_settings(path)   # ConfigError names the key

    def shell(self, block: Block, command: str, expected_exit: int | None) -> None:
        if command.startswith("export "):   # the commands after it see the variables, as in one shell
            for assignment in shlex.split(self.swap(command))[1:]:
                name, _, value = assignment.partition("=")
                self.env[name] = value
            return
        r = subprocess.run(["bash", "-c", self.swap(command)], cwd=self.dir, env=self.env, capture_output=True,
                           text=True, timeout=300)
        out = r.stdout + r.stderr
        where = f"{block.where}: $ {command}\n{out[-3000:]}"
        assert "Traceback (most recent call last)" not in out, where
        if expected_exit is None:
            assert r.returncode == 0, where
        elif 'echo "exit $?"' in command:
            assert r.stdout.rstrip().endswith(f"exit {expected_exit}"), where
        else:   # the docs show the status without printing it
            assert r.returncode == expected_exit, where

    def serve(self, block: Block, command: str) -> None:
        self.stop()
        log_path = os.path.join(self.dir, "serve.log")
        with open(log_path, "w") as log:
            self.daemon = subprocess.Popen(["bash", "-c", "exec " + self.swap(command)], cwd=self.dir, env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT)
        with open(os.path.join(self.dir, "serve.pid"), "w") as f:
            f.write(f"{self.daemon.pid}\n")
        deadline = time.monotonic() + 120
        while True:
            with open(log_path) as f:
                text = f.read()
            if "kvstore: serving on" in text:
                return
            assert self.daemon.poll() is None, f"{block.where}: $ {command}\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"{block.where}: $ {command} never served\n{text[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.daemon = None


DOCS = [os.path.relpath(p, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) for p in documents()]


def test_every_block_is_run_or_marked_with_a_reason():
    unmarked = [b.where for path in documents() for b in blocks_of(path) if b.kind()[0] == "unmarked"]
    no_reason = [b.where for path in documents() for b in blocks_of(path) if b.kind() == ("skip", "")]
    assert not unmarked and not no_reason, (unmarked, no_reason)


@pytest.mark.parametrize("doc", DOCS)
def test_document_blocks_run(doc, tmp_path, capsys):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    blocks = blocks_of(os.path.join(repo, doc))
    session = Session(tmp_path / "session")
    try:
        for block in blocks:
            session.run(block)
    finally:
        session.stop()
    skipped = sum(b.kind()[0] in ("skip", "output") for b in blocks)
    with capsys.disabled():
        print(f"\n{doc}: ran {session.ran} of {len(blocks)} blocks ({skipped} marked skip or output)")

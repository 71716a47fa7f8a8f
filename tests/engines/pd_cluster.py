"""Prefill/decode serving for tests and benchmarks: vLLM OpenAI servers (the engine venv's python,
engine core in its own process, as deployed) and ``kvstore pd-proxy`` in front of them.

    server = VllmServer.start(python, model_dir, workdir, "prefill", kv_transfer_config)
    proxy = PdProxy.start(workdir, [prefill.url], [decode.url])
    out = complete(proxy.url, model_dir, prompt, max_tokens=8)   # {"token_ids", "answer", ...}
    metrics(decode.url)["vllm:kvstore_pd_loaded_blocks"]
    server.stop(); proxy.stop()

By default a server starts without its tokenizer (``--skip-tokenizer-init``) and prompts are token
ids; with ``tokenizer=True`` it tokenizes text prompts itself. Answers are read as token ids
(``return_token_ids``). Greedy sampling, ``ignore_eos``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ports import closed_port

HERE = os.path.dirname(os.path.abspath(__file__))


def _http(req: str | urllib.request.Request, timeout_s: float) -> tuple[int, bytes]:
    """(status, body) of one HTTP request: an error status is an answer too."""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """As ``_http``; status 0 when nothing answers (a server still starting)."""
    try:
        return _http(url, timeout_s)
    except OSError:
        return 0, b""


def _post(url: str, body: dict, timeout_s: float = 300.0) -> tuple[int, bytes]:
    return _http(urllib.request.Request(url, data=json.dumps(body).encode(),
                                        headers={"Content-Type": "application/json"}), timeout_s)


class _Process:
    """A child process in its own process group, with its log file."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: str) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def wait_healthy(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path}: exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if _get(self.url + path, 2.0)[0] == 200:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.log_path}: not healthy after {timeout_s:.0f}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL the whole group (a server's engine core too), at once."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _spawn(cmd: list[str], log_path: str, env: dict, cwd: str, cpus: list[int] | None = None) -> subprocess.Popen:
    """``cpus``: the cores the process and every process and thread it starts may run on."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=pin)


class VllmServer(_Process):
    """A vLLM OpenAI server. Its port is picked free, then bound by the server seconds later: when
    another process took it meanwhile, ``wait_healthy`` starts the server again on another port."""

    def wait_healthy(self, path: str, timeout_s: float) -> None:
        for _ in range(3):
            try:
                return super().wait_healthy(path, timeout_s)
            except RuntimeError:
                if "Address already in use" not in self.log():
                    raise
            self.stop()
            again = self.start(*self._args, **{**self._kwargs, "wait": False})
            self.proc, self.url, self.log_path = again.proc, again.url, again.log_path
        return super().wait_healthy(path, timeout_s)

    @classmethod
    def start(cls, python: str, model_dir: str, workdir: str, name: str, kv_transfer_config: dict | None,
              kv_cache_bytes: int = 64 * 2**20, wait: bool = True, env_extra: dict | None = None,
              max_model_len: int = 1024, tokenizer: bool = False, prefix_caching: bool = False,
              cpus: list[int] | None = None, max_num_batched_tokens: int | None = None) -> "VllmServer":
        """``tokenizer``: load the model's tokenizer (text prompts); ``prefix_caching``: vLLM's own
        prefix cache on (answers then report their cached prompt tokens); ``cpus``: the cores the
        whole server (API server and engine core processes) may run on; ``max_num_batched_tokens``:
        vLLM's token budget of one step (None: vLLM's default)."""
        args = (python, model_dir, workdir, name, kv_transfer_config)
        kwargs = dict(kv_cache_bytes=kv_cache_bytes, env_extra=env_extra, max_model_len=max_model_len,
                      tokenizer=tokenizer, prefix_caching=prefix_caching, cpus=cpus,
                      max_num_batched_tokens=max_num_batched_tokens)
        port = closed_port()
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager", "--seed", "0",
               "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_bytes),
               "--max-num-seqs", "8"]
        cmd += [] if tokenizer else ["--skip-tokenizer-init"]
        if max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"] if prefix_caching \
            else ["--no-enable-prefix-caching"]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON"))}
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
                    **(env_extra or {})})
        server = cls(_spawn(cmd, os.path.join(workdir, f"{name}.log"), env, workdir, cpus), f"http://127.0.0.1:{port}",
                     os.path.join(workdir, f"{name}.log"))
        server._args, server._kwargs = args, kwargs
        if wait:
            server.wait_healthy("/health", 300)
        return server


class PdProxy(_Process):
    @classmethod
    def start(cls, workdir: str, prefill_urls: list[str], decode_urls: list[str]) -> "PdProxy":
        port = closed_port()

        def split(urls):
            hostports = [u.rsplit("//", 1)[-1].rsplit(":", 1) for u in urls]
            return [h for h, _ in hostports], [p for _, p in hostports]

        ph, pp = split(prefill_urls)
        dh, dp = split(decode_urls)
        cmd = [sys.executable, "-P", "-m", "kvstore.ops.cli", "pd-proxy", "--port", str(port),
               "--prefiller-hosts", *ph, "--prefiller-ports", *pp, "--decoder-hosts", *dh, "--decoder-ports", *dp]
        log = os.path.join(workdir, "pd-proxy.log")
        proxy = cls(_spawn(cmd, log, dict(os.environ), workdir), f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + 30
        while _get(proxy.url + "/healthcheck")[0] == 0 and time.monotonic() < deadline:
            if proxy.proc.poll() is not None:
                raise RuntimeError(proxy.log())
            time.sleep(0.2)
        return proxy


def complete(url: str, model: str, prompt: str | list[int], max_tokens: int, stream: bool = False,
             extra: dict | None = None) -> dict:
    """One /v1/completions request (greedy); its generated token ids, and the raw answer (not
    streamed: its ``choices[0]`` also has the ``prompt_token_ids``). Streamed: the ids and when
    each server-sent event reached the client (``arrivals``, seconds after the request was sent),
    read as they come, so a proxy that held the answer back shows as one burst."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **(extra or {})}
    if not stream:
        status, raw = _post(url + "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"{url}: HTTP {status}: {raw[:500]!r}")
        answer = json.loads(raw)
        return {"token_ids": answer["choices"][0]["token_ids"], "answer": answer}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    ids, arrivals, sent = [], [], time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=300.0) as resp:
            for raw_line in resp:
                line = raw_line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic() - sent)
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    return {"token_ids": ids, "events": len(arrivals), "arrivals": arrivals}


def tokenize(url: str, model: str, text: str) -> list[int]:
    """The token ids a server with its tokenizer makes of ``text`` (``/tokenize``: nothing runs)."""
    status, raw = _post(url + "/tokenize", {"model": model, "prompt": text})
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {raw[:500]!r}")
    return json.loads(raw)["tokens"]


def metrics(url: str, prefix: str = "vllm:kvstore_") -> dict[str, float]:
    """The server's Prometheus counters starting with ``prefix`` (summed over label sets)."""
    status, raw = _get(url + "/metrics")
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith(prefix) and " " in line:
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            if name.endswith("_created"):   # the series' creation time, not a count
                continue
            name = name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(value)
    return out

#!/usr/bin/env bash
# The one test command (README: `make test`): builds the environments from the project's own files,
# starts the services the tests need, and runs the whole suite in one pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q -U pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'

# Redis for the fleet tests: use the one on 6379 if it answers, else start our own there.
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  if ! command -v redis-server >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && break; sleep 0.1; done
fi

# systemd-analyze lints deploy/kvstore.service (tests/test_deploy.py).
if ! command -v systemd-analyze >/dev/null; then
  apt-get update -qq && apt-get install -y -qq systemd >/dev/null || true
fi

# tmux runs `kvstore top` on a terminal of a given size (tests/test_top_screen.py).
if ! command -v tmux >/dev/null; then
  apt-get update -qq && apt-get install -y -qq tmux >/dev/null || true
fi

# Engine environments (vLLM, SGLang, LMCache) live outside the clone, keyed by their pins.
for engine in $(ls connectors/requirements/*.txt 2>/dev/null | xargs -n1 basename 2>/dev/null | sed 's/\.txt$//'); do
  path=$(scripts/engine-venv.sh "$engine")
  export "KVSTORE_VENV_$(echo "$engine" | tr a-z A-Z)=$path"
done
# The real pretrained model (SmolLM2-135M-Instruct, bf16) from its PyPI wheel, converted once in the vLLM venv.
KVSTORE_REAL_MODEL=$(scripts/real-model.sh)
export KVSTORE_REAL_MODEL

exec .venv/bin/python -m pytest "$@"

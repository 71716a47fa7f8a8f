#!/usr/bin/env bash
# Every CUDA test and GPU benchmark, in one run that fits a lent GPU session (< 8 minutes).
#
# On the device machine (the `device` tool), from the repository root:
#     bash benchmarks/gpu_check.sh            # results and logs land in $OUT (or /tmp/gpu_check)
# The device image has torch, numpy, xxhash, grpcio, protobuf, prometheus-client, rich and pyyaml but
# no network. Wheels of the rest (pydantic, pydantic-settings, grpcio-health-checking,
# grpcio-reflection, redis, zstandard, numba/llvmlite) travel in .whl/ (see docs/gpu.md) and are
# installed from there without an index.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/kvstore-site
fail=0
rm -rf "$SITE"   # a warm machine keeps the last run's install; pip --target would not replace it
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || fail=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
fi
"$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" . >/dev/null
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# -P: the checkout's kvstore/ must not shadow the installed package (it lacks kvstore.tiers etc.)
# 1. CUDA tests: GPU tier (device pool), codecs on CUDA (byte-identical to CPU), a client decoding
#    compressed blocks from a real daemon into CUDA tensors, the vLLM connector's copies (pinned
#    host buffers, copy stream, per-layer events) and its GPU layout names
step cuda_tests 240 "$PY" -P -m pytest -q -p no:cacheprovider --rootdir=. \
  tests/test_codecs_cuda.py tests/test_tiers.py tests/test_codec_transfer.py tests/test_vllm_paged_copies.py tests/test_client_encoded_puts.py \
  tests/test_vllm_layouts.py -k "cuda or gpu or layout or layer_name or backend"
# 2. GPU benchmarks: codec encode/decode GB/s on the GPU vs device memcpy
step bench_codecs 150 "$PY" benchmarks/bench_codecs.py --device cuda --threads 1 --out "$OUT"
# 3. SGLang end to end (real Engine: generate, flush device cache, regenerate, cached tokens > 0)
#    skips itself when sglang is not installed on the device image
step sglang_e2e 90 "$PY" tests/engines/sglang_gpu_e2e.py

echo "gpu_check: $([ $fail -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $fail

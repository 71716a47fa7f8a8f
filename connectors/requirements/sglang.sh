# sglang without its declared deps (sgl-kernel, flashinfer, ... are GPU-only); sglang.txt has what it needs.
"$VENV/bin/python" -m pip install -q --no-deps sglang==0.5.23

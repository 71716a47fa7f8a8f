#!/usr/bin/env bash
# Build (once) and print the path of an engine's virtual environment.
#
#   scripts/engine-venv.sh vllm   ->  ~/.cache/kvstore/venvs/vllm-<hash>
#
# The venv is built from connectors/requirements/<engine>.txt (pins, passed to pip) and, if present,
# connectors/requirements/<engine>.sh (extra steps, run with $VENV set), then kvstore itself is
# installed into it without dependencies. The directory name carries a hash of both files, so a
# change of pins builds a fresh venv and an unchanged one is reused across CI runs.
# KVSTORE_VENV_PINS=DIR reads the pins from DIR instead, and KVSTORE_VENV_WITHOUT_KVSTORE=1 leaves
# kvstore out (benchmarks/peers/peer-venv.sh builds the peers' venvs this way).
set -euo pipefail
engine=$1
root=$(cd "$(dirname "$0")/.." && pwd)
pins=${KVSTORE_VENV_PINS:-$root/connectors/requirements}
req="$pins/$engine.txt"
post="$pins/$engine.sh"
[ -f "$req" ] || { echo "no pins for '$engine' ($req)" >&2; exit 2; }
key=$({ cat "$req"; [ ! -f "$post" ] || cat "$post"; } | sha256sum | cut -c1-16)
cache=${KVSTORE_VENV_CACHE:-$HOME/.cache/kvstore/venvs}
venv="$cache/$engine-$key"
mkdir -p "$cache"
exec 9>"$cache/$engine.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "building $engine venv in $venv (first run only)" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -U pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  if [ -f "$post" ]; then VENV="$venv" bash "$post" >&2; fi
  touch "$venv/.complete"
fi
# kvstore itself (editable, so the venv always runs this checkout's code)
if [ "${KVSTORE_VENV_WITHOUT_KVSTORE:-0}" != 1 ]; then
  # built with the venv's own setuptools, which must read pyproject's SPDX license (>= 77)
  "$venv/bin/python" -m pip install -q "setuptools>=77" >&2
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
fi
echo "$venv"

#!/usr/bin/env bash
# Build (once) and print the path of a peer's virtual environment, the way scripts/engine-venv.sh
# builds the engine venvs, from benchmarks/peers/<peer>.txt (pins) and, if present, <peer>.sh (extra
# steps, run with $VENV set):
#
#   benchmarks/peers/peer-venv.sh mooncake   ->  ~/.cache/kvstore/venvs/mooncake-<hash>
#
# The name carries a hash of both files, so changed pins build a fresh venv and unchanged ones are
# reused. kvstore itself is not installed: the peer drivers (benchmarks/peers/*_driver.py) import only
# the peer and the standard library.
set -euo pipefail
peer=$1
here=$(cd "$(dirname "$0")" && pwd)
req="$here/$peer.txt"
post="$here/$peer.sh"
[ -f "$req" ] || { echo "no pins for peer '$peer' ($req)" >&2; exit 2; }
key=$({ cat "$req"; [ ! -f "$post" ] || cat "$post"; } | sha256sum | cut -c1-16)
cache=${KVSTORE_VENV_CACHE:-$HOME/.cache/kvstore/venvs}
venv="$cache/$peer-$key"
mkdir -p "$cache"
exec 9>"$cache/$peer.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "building $peer venv in $venv (first run only)" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -U pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  if [ -f "$post" ]; then VENV="$venv" bash "$post" >&2; fi
  touch "$venv/.complete"
fi
echo "$venv"

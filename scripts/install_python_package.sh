#!/usr/bin/env bash
# `pip install .` (libkda, libkda.torch, libkda.jax) quietly: the log is shown only on failure,
# which fails the caller.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log=$(mktemp)
if ! "$PY" -m pip install -q --disable-pip-version-check . > "$log" 2>&1; then
  cat "$log"
  rm -f "$log"
  exit 1
fi
rm -f "$log"

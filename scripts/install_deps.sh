#!/usr/bin/env bash
# Installs everything libkda needs on a fresh Debian machine: the C++ toolchain and GoogleTest
# from Debian's packages, the Python build and test tools from PyPI. Safe to re-run.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
need_apt=0
for tool in cmake ninja g++; do command -v "$tool" >/dev/null 2>&1 || need_apt=1; done
[ -f /usr/include/gtest/gtest.h ] || need_apt=1
if [ "$need_apt" = 1 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    cmake ninja-build g++ libgtest-dev libgomp1 python3 python3-pip python3-venv python3-dev >/dev/null
fi
PY="${PYTHON:-python3}"
log=$(mktemp)
# A failed install must fail the script (the torch/jax tests would otherwise only skip).
if ! "$PY" -m pip install -q --disable-pip-version-check numpy ml_dtypes pytest "scikit-build-core>=0.10" \
    "nanobind>=2" "torch>=2.4" "jax>=0.5" jaxtyping "fla-core==0.6.0" > "$log" 2>&1; then
  cat "$log"
  exit 1
fi
grep -v "Running pip as the 'root' user" "$log" || true
rm -f "$log"

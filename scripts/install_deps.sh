#!/usr/bin/env bash
# Installs everything libkda needs on a fresh Debian machine: the C++ toolchain and GoogleTest
# from Debian's packages, the Python build and test tools from PyPI. Safe to re-run.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
need_apt=0
tools="cmake ninja g++"
# x86-64 hosts also cross-build the C++ suite for AArch64 and run it under qemu (scripts/test_aarch64.sh).
if [ "$(uname -m)" = "x86_64" ]; then tools="$tools aarch64-linux-gnu-g++ qemu-aarch64"; fi
for tool in $tools; do command -v "$tool" >/dev/null 2>&1 || need_apt=1; done
[ -f /usr/include/gtest/gtest.h ] || need_apt=1
if [ "$need_apt" = 1 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    cmake ninja-build g++ libgtest-dev libgomp1 python3 python3-pip python3-venv python3-dev >/dev/null
  if [ "$(uname -m)" = "x86_64" ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      g++-aarch64-linux-gnu qemu-user >/dev/null
  fi
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

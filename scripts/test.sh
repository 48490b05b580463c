#!/usr/bin/env bash
# Runs every test: the C++ suite through ctest (both CPU targets) and the Python suite through
# pytest after `pip install .`. With --sanitize, also the C++ suite under ASan + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
bash scripts/install_deps.sh
PY="${PYTHON:-python3}"

echo "== C++: build (release) and ctest"
cmake --preset release >/dev/null
cmake --build --preset release
ctest --preset release -j "$(nproc)"

if [ "${1:-}" = "--sanitize" ]; then
  echo "== C++: ASan + UBSan build and ctest"
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j "$(nproc)"
fi

echo "== Python: pip install . and pytest"
"$PY" -m pip install -q --disable-pip-version-check . 2>&1 | grep -v "Running pip as the 'root' user" || true
# Run from tests/ so `import libkda` resolves to the installed package, not python/libkda.
# pytest exits 5 when it collects nothing; set -e turns that into a failure.
(cd tests/python && "$PY" -m pytest -q -p no:cacheprovider .)

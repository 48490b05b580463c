#!/usr/bin/env bash
# The main job: builds libkda, times it next to FLA's CPU-runnable implementations (bench/peers.py,
# FLA's own fla-core package), then runs kda-bench on the SPEC.md section 5 workloads, every fused
# path next to its staged baseline, ending with its table. Extra arguments go to kda-bench;
# KDA_BENCH_PEERS=0 skips the peers (about 3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
PY="${PYTHON:-python3}"
bash scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target kda-bench
mkdir -p bench-results
if [ "${KDA_BENCH_PEERS:-1}" != "0" ]; then
  echo "== peers: pip install . (libkda.torch), then bench/peers.py"
  bash scripts/install_python_package.sh
  (cd bench-results && "$PY" ../bench/peers.py --json peers.json)
fi
echo "== kda-bench"
./build/release/bench/kda-bench --baseline --json bench-results/latest.json "$@"

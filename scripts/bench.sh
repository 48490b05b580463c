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
peers_failed=0
if [ "${KDA_BENCH_PEERS:-1}" != "0" ]; then
  echo "== peers: pip install . (libkda.torch), then bench/peers.py"
  bash scripts/install_python_package.sh
  # A failed peer run is reported and fails the job, after kda-bench has still run.
  (cd bench-results && "$PY" ../bench/peers.py --json peers.json) || peers_failed=1
fi
echo "== kda-bench"
./build/release/bench/kda-bench --baseline --json bench-results/latest.json "$@"
if [ "$peers_failed" = 1 ]; then
  echo "scripts/bench.sh: bench/peers.py failed (its error is above the kda-bench output)" >&2
  exit 1
fi

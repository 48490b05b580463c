#!/usr/bin/env bash
# The main job: builds libkda and runs kda-bench on the SPEC.md section 5 workloads, every fused
# path next to its staged baseline, ending with a table. Extra arguments go to kda-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
bash scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target kda-bench
mkdir -p bench-results
./build/release/bench/kda-bench --baseline --json bench-results/latest.json "$@"

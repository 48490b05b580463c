#!/usr/bin/env bash
# The CUDA backend on a GPU machine (docs/CUDA.md, issue 7): configure with KDA_CUDA=ON, build,
# run the CUDA tests (ctest) and the compute-sanitizer checks on small cases, then the GPU
# benchmark. Sized for the H200 device machine (16 cores): well under 8 minutes.
#
#   bash scripts/device_check.sh
#
# Results go to $OUT (the device tool's output folder; default build/device-out), at most 7
# files: env.txt, build.log, ctest.log, sanitizer.log, bench.log, bench.json, summary.txt.
# GoogleTest: if the machine has no installed GTest, put its sources in .deps/googletest
# (cp -r /usr/src/googletest .deps/; echo /.deps/ >> .git/info/exclude) and carry .deps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build/device-out}"
mkdir -p "$OUT"
JOBS="${JOBS:-16}"
BUILD="${BUILD:-build/device}"
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() {
  echo "== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"
}

{
  date -u
  nvidia-smi 2>&1
  echo; nvcc --version 2>&1
  echo; cmake --version 2>&1 | head -1
  echo; g++ --version 2>&1 | head -1
  echo; command -v compute-sanitizer ninja python3
} >"$OUT/env.txt" 2>&1
note "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
GTEST=()
[ -d .deps/googletest ] && GTEST=(-DKDA_GTEST_SOURCE_DIR="$PWD/.deps/googletest")

# 1. Configure and build (tests and bench; the CPU kernels come along).
TESTS=ON
if ! cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKDA_CUDA=ON -DKDA_BUILD_PYTHON=OFF \
    "${GTEST[@]}" >"$OUT/build.log" 2>&1; then
  note "configure failed with tests; retrying without them (no GTest? see the header of this script)"
  TESTS=OFF
  rm -rf "$BUILD"
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKDA_CUDA=ON -DKDA_BUILD_PYTHON=OFF \
    -DKDA_BUILD_TESTS=OFF >>"$OUT/build.log" 2>&1 || { note "configure failed: see build.log"; exit 1; }
fi
TARGETS=(kda-cuda-bench)
[ "$TESTS" = ON ] && TARGETS+=(kda_tests)
B0=$(date +%s)
if ! cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >>"$OUT/build.log" 2>&1; then
  note "build failed: see build.log"
  tail -30 "$OUT/build.log"
  exit 1
fi
note "built ${TARGETS[*]} in $(( $(date +%s) - B0 ))s"

# 2. CUDA tests: every test whose name has Cuda (GPU tests and the host emulation of the kernels),
#    each in its own process, so a kernel fault in one cannot hide the others. KDA_CUDA_SYNC=1
#    makes every call wait for its kernels and report their errors.
if [ "$TESTS" = ON ]; then
  export KDA_CUDA_SYNC=1
  TEST_BIN="$BUILD/tests/cpp/kda_tests"
  # A quick first look: one small case, so a crash shows up at the top of the log.
  timeout 60 "$TEST_BIN" --gtest_filter='Cuda/CudaForward.MatchesOracle/option_softplus_float32' >"$OUT/ctest.log" 2>&1
  note "smoke test rc=$? ($(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/ctest.log" | head -1))"
  timeout 300 ctest --test-dir "$BUILD" -R 'Cuda' -j 8 --timeout 120 --output-on-failure >>"$OUT/ctest.log" 2>&1
  rc=$?
  note "ctest -R Cuda rc=$rc: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1);" \
    "skipped: $(grep -c '\*\*\*Skipped' "$OUT/ctest.log") (0 expected on a GPU)"
  grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)' "$OUT/ctest.log" | head -40 | tee -a "$SUMMARY"

  # 3. compute-sanitizer on small cases (races in shared memory, out-of-bounds accesses). Works on
  #    the Firecracker runtime, not on gVisor (docs of the device tool); failures to start are noted.
  if command -v compute-sanitizer >/dev/null 2>&1; then
    SMALL='Cuda/CudaForward.MatchesOracle/option_chunk16_float32:Cuda/CudaForward.MatchesOracle/extreme_gates_K64_V64:Cuda/CudaDecode.MatchesOracle/logdecay_f32_draft_tokens'
    for tool in racecheck memcheck synccheck; do
      timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 "$TEST_BIN" --gtest_filter="$SMALL" \
        >>"$OUT/sanitizer.log" 2>&1
      note "compute-sanitizer --tool $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
    done
  else
    note "compute-sanitizer not found"
  fi
fi

# 4. Benchmark: SPEC.md section 5 shapes, median of 20 runs after 3 warm-ups, L2 flushed.
unset KDA_CUDA_SYNC
timeout 240 "$BUILD/kda-cuda-bench" --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
note "kda-cuda-bench rc=$?"
cat "$OUT/bench.log" | tee -a "$SUMMARY"
note "done"

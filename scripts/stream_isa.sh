#!/usr/bin/env bash
# How much one core streams with 128-bit against 512-bit vectors: the in-place update of
# kda-bench's bandwidth limit (a[i] = a[i] * 0.9999 + 0.0001 over 128 MB, read + write bytes),
# compiled once for the baseline x86-64 ISA and once for AVX-512, timed alternately (median of 5
# passes each, all threads), for ROUNDS rounds (default 20, one every 0.2 s). docs/PERF.md
# (eleventh session) quotes it: the machines stream at about 55 GB/s with either loop, or, in
# their fast periods, noticeably more with the 512-bit one. x86-64 with AVX-512 only.
set -euo pipefail
rounds="${1:-20}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat >"$dir/stream_isa.cpp" <<'EOF'
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

static void pass_baseline(float* a, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) a[i] = a[i] * 0.9999f + 0.0001f;
}
__attribute__((target("avx512f,prefer-vector-width=512"))) static void pass_avx512(float* a, std::int64_t n) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) a[i] = a[i] * 0.9999f + 0.0001f;
}
template <typename F>
static double gbps(F pass, float* a, std::int64_t n) {
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pass(a, n);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 8.0 * n / t[2] / 1e9;
}
int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const std::int64_t n = 32ll << 20;  // 128 MB
  const std::size_t bytes = n * sizeof(float);
  float* a = static_cast<float*>(std::aligned_alloc(2 << 20, bytes));
  madvise(a, bytes, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i & 1023);
  for (int r = 0; r < rounds; ++r) {
    const double base = gbps(pass_baseline, a, n), wide = gbps(pass_avx512, a, n);
    std::printf("128-bit %6.1f GB/s   512-bit %6.1f GB/s\n", base, wide);
    std::fflush(stdout);
    usleep(200000);
  }
}
EOF
# GCC: its OpenMP outlining keeps pass_avx512's target attribute (clang's drops it, and ignores
# prefer-vector-width, so it would compare 128 bits with 128 bits).
g++ -O3 -fopenmp "$dir/stream_isa.cpp" -o "$dir/stream_isa"
"$dir/stream_isa" "$rounds"

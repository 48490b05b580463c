// Measured limits of this machine, with all threads: fp32 FMA peak (the widest FMA the CPU has:
// 512-bit with AVX-512, else 256-bit with AVX2 + FMA), bf16 dot-product peak
// (AVX-512 BF16 vdpbf16ps), streaming memory bandwidth (in-place update, read + write bytes). kda-bench prints them
// first and reports every result as a percentage of the matching one.
#include "machine_limits.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "kda/memory.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kda_bench {
namespace {

constexpr int kChains = 12;  // independent accumulators: enough to cover FMA latency x 2 ports

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs body(iters) on every thread at once and returns the flops per second of all threads.
template <typename Body>
double parallel_rate(int threads, double flops_per_iter, Body body) {
  const std::int64_t iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<float> sink(static_cast<std::size_t>(threads) * 16);
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    { sink[static_cast<std::size_t>(omp_get_thread_num()) * 16] = body(iters); }
    const double dt = seconds_since(t0);
    best = std::max(best, flops_per_iter * static_cast<double>(iters) * threads / dt);
  }
  return best;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float fma_loop(std::int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  for (std::int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// The same on 256-bit vectors, for CPUs with AVX2 + FMA and no AVX-512 (the avx2 target).
__attribute__((target("avx2,fma"))) float fma_loop_avx2(std::int64_t iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.0001f);
  for (std::int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[7];
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_loop(std::int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x0001);
  for (std::int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#endif

// The stream's loop over [lo, hi). stream_range_avx512 is the same loop compiled for AVX-512 (it
// inlines stream_range), where the vector width decides how much one core can move: measured
// side by side, 71-108 GB/s with 128-bit vectors against 104-131 with 512-bit ones when the machine
// streams fast (equal near 55 GB/s). The limit is what the best code can move, so the widest the
// CPU runs is used. The per-thread range function carries the target attribute, not the parallel
// region: compilers outline that region without it.
inline void stream_range(float* a, std::int64_t lo, std::int64_t hi) {
  for (std::int64_t i = lo; i < hi; ++i) a[i] = a[i] * 0.9999f + 0.0001f;
}

#if defined(__x86_64__)
#if defined(__clang__)
#define KDA_BENCH_AVX512 __attribute__((target("avx512f"), min_vector_width(512)))
#else
#define KDA_BENCH_AVX512 __attribute__((target("avx512f,prefer-vector-width=512")))
#endif
KDA_BENCH_AVX512 void stream_range_avx512(float* a, std::int64_t lo, std::int64_t hi) {
  stream_range(a, lo, hi);
}
__attribute__((target("avx2,fma"))) void stream_range_avx2(float* a, std::int64_t lo, std::int64_t hi) {
  stream_range(a, lo, hi);
}
#endif

}  // namespace

double stream_update_seconds(float* a, std::int64_t n, int threads) {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    // static schedule: thread t streams the t-th contiguous share
    const std::int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const std::int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
#if defined(__x86_64__)
    if (avx512)
      stream_range_avx512(a, lo, hi);
    else if (avx2)
      stream_range_avx2(a, lo, hi);
    else
#endif
      stream_range(a, lo, hi);
  }
  return seconds_since(t0);
}

std::unique_ptr<float, void (*)(void*)> stream_buffer(std::int64_t n, int threads) {
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const std::size_t bytes = (static_cast<std::size_t>(n) * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  float* a = static_cast<float*>(std::aligned_alloc(kHuge, bytes));
  if (a != nullptr) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(a, bytes, MADV_HUGEPAGE);
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i & 1023);
  }
  return {a, std::free};
}

MachineLimits measure_limits(int threads) {
  MachineLimits m;
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    // 16 lanes x 2 flops per FMA
    m.fp32_fma_gflops = parallel_rate(nt, kChains * 32.0, fma_loop) / 1e9;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    m.fp32_fma_gflops = parallel_rate(nt, kChains * 16.0, fma_loop_avx2) / 1e9;  // 8 lanes x 2 flops
  }
  if (__builtin_cpu_supports("avx512bf16")) {
    // 32 bf16 pairs x 2 flops per vdpbf16ps
    m.bf16_dot_gflops = parallel_rate(nt, kChains * 64.0, bf16_loop) / 1e9;
  }
#endif
  // Bandwidth: an in-place streaming update of 512 MB (each line read once and written back
  // once, the access pattern of a decode step on its state pool); read + write bytes count. A
  // copy into a second array would also pay the write-allocate reads and understate what the
  // memory system moves for an in-place update.
  const std::int64_t n = 128ll << 20;
  // Through the library's allocator, so pages are placed as they are for the library's tensors.
  kda::Buffer buf(kda::allocate(static_cast<std::size_t>(n) * sizeof(float)));
  float* a = static_cast<float*>(buf.get());
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i & 1023);
  std::vector<double> times;
  for (int it = 0; it < 5; ++it) times.push_back(stream_update_seconds(a, n, nt));
  std::sort(times.begin(), times.end());
  m.bandwidth_gbps = 2.0 * n * sizeof(float) / times[times.size() / 2] / 1e9;
  m.threads = nt;
  return m;
}

}  // namespace kda_bench

// Measured machine limits for kda-bench (see machine_limits.cpp).
#pragma once

#include <cstdint>
#include <memory>

namespace kda_bench {

struct MachineLimits {
  double fp32_fma_gflops = 0;  // 0: not measurable here (neither AVX-512 nor AVX2 + FMA)
  double bf16_dot_gflops = 0;  // 0: no AVX-512 BF16
  double bandwidth_gbps = 0;   // in-place streaming update, read + write bytes
  int threads = 0;
};

MachineLimits measure_limits(int threads);

// One in-place streaming pass a[i] = a[i] * 0.9999 + 0.0001 over n floats with `threads`
// threads (the bandwidth limit's kernel); returns its seconds. Read + write bytes: 8 n.
double stream_update_seconds(float* a, std::int64_t n, int threads);

// n floats for stream_update_seconds, 2 MB aligned and offered to transparent huge pages like the
// library's tensors, but outside the library's memory accounting (so a side-by-side stream does
// not show in a suite's measured peak memory). Filled; null when out of memory.
std::unique_ptr<float, void (*)(void*)> stream_buffer(std::int64_t n, int threads);

}  // namespace kda_bench

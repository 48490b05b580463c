// Measured machine limits for kda-bench (see machine_limits.cpp).
#pragma once

namespace kda_bench {

struct MachineLimits {
  double fp32_fma_gflops = 0;  // 0: not measurable here (no AVX-512)
  double bf16_dot_gflops = 0;  // 0: no AVX-512 BF16
  double bandwidth_gbps = 0;   // in-place streaming update, read + write bytes
  int threads = 0;
};

MachineLimits measure_limits(int threads);

}  // namespace kda_bench

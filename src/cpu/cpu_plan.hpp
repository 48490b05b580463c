// What the per-target CPU kernels receive besides the Problem: the work order and the row
// offsets of the staged path's full-size buffers. Built once per call in dispatch.cpp (compiled
// for the baseline ISA) so kernel translation units need no standard containers.
#pragma once

#include <cstdint>

#include "core/problem.hpp"

namespace kda::cpu {

struct CpuPlan {
  // Work items (segment index * HV + value head), longest segment first, so dynamic scheduling
  // balances uneven packs (N = 25 segments, H not a multiple of the thread count).
  const std::int64_t* order = nullptr;
  std::int64_t num_items = 0;
  // Staged path only: first row of segment s in the (rows, ...) buffers, where every segment
  // occupies ceil(length / C) * C rows, and its first chunk index.
  const std::int64_t* row_offset = nullptr;
  const std::int64_t* chunk_offset = nullptr;
  const std::int64_t* chunk_segment = nullptr;  // segment of each chunk
  std::int64_t total_rows = 0;
  std::int64_t total_chunks = 0;
};

// Whether large K-first decode calls run in column strips on this CPU (dispatch.cpp,
// choose_decode_strips: AMD's default, KDA_DECODE_STRIPS=auto|on|off).
bool k_first_decode_strips();

#define KDA_DECLARE_CPU_TARGET(ns)                                                                    \
  namespace ns {                                                                                      \
  Status forward(const detail::Problem& problem, const ForwardParams& params, const CpuPlan& plan);   \
  Status backward(const detail::Problem& problem, const BackwardParams& params, const CpuPlan& plan); \
  Status decode(const detail::Problem& problem, const DecodeParams& params);                          \
  }

KDA_DECLARE_CPU_TARGET(avx512)
KDA_DECLARE_CPU_TARGET(avx2)
KDA_DECLARE_CPU_TARGET(generic)

}  // namespace kda::cpu

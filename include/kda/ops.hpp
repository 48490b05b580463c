// Public operations. One plain params struct per operation; no framework types.
#pragma once

#include <cstdint>

#include "kda/options.hpp"
#include "kda/status.hpp"
#include "kda/tensor.hpp"

namespace kda {

// Inputs and outputs of the forward (SPEC.md 1.1, 1.2). Logical shapes, any strides:
//   q, k         [B, T, H, K]      fp32 / bf16 / fp16
//   v            [B, T, HV, V]     fp32 / bf16 / fp16, HV % H == 0
//   g            [B, T, HV, K]     log decay (<= 0), or the raw gate with use_gate_in_kernel
//   beta         [B, T, HV]        beta, or its logits with use_beta_sigmoid_in_kernel
//   A_log        [HV]              optional (gate in kernel)
//   dt_bias      [HV * K] or [HV, K]  optional (gate in kernel)
//   o            [B, T, HV, V]     output, dtype of q (the oracle also accepts fp64)
// Sequences: at most one of
//   cu_seqlens   [N + 1]  int32/int64, B must be 1
//   segment_ids  [T] or [B, T] int32, 1-indexed, 0 = padding (tail only); needs max_num_segments
// States (V-first swaps the last two dims), fp32 (initial_state: any float dtype):
//   fixed [B, HV, K, V]; cu_seqlens [N, HV, K, V]; segment_ids [B, max_num_segments, HV, K, V]
struct ForwardParams {
  TensorView q, k, v, g, beta;
  TensorView A_log, dt_bias;
  TensorView cu_seqlens, segment_ids;
  std::int64_t max_num_segments = 0;
  TensorView initial_state;  // optional
  TensorView o;              // required
  TensorView final_state;    // optional output
  Options options;
};

// The chunked forward on the CPU, by options.path (fused or staged).
Status chunk_forward(const ForwardParams& params);

// The exact recurrence of SPEC.md section 1 in fp64: the oracle. Accepts fp64 inputs and
// outputs as well as the kernel dtypes. options.path, chunk_size and num_threads are ignored.
Status reference_forward(const ForwardParams& params);

// Checks params for chunk_forward without running it.
Status validate_forward(const ForwardParams& params);

}  // namespace kda

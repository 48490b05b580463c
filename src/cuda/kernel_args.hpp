// Plain argument structs of the CUDA kernels: pointers, dtypes, element strides and sizes, passed
// by value as kernel parameters. Built on the host from a validated detail::Problem by
// src/cuda/plan.hpp; read by src/cuda/forward_block.cuh and src/cuda/decode_block.cuh.
#pragma once

#include <cstdint>

namespace kda::cuda {

// A float tensor of up to 4 dims: element (i0, i1, i2, i3) at i0*s[0] + i1*s[1] + i2*s[2] + i3*s[3].
struct DTensor {
  const void* data = nullptr;
  int dtype = 0;  // kF32 / kBF16 / kF16 / kF64 of device_math.cuh
  std::int64_t s[4] = {0, 0, 0, 0};
};

// A state tensor addressed like detail::StateAddressing: state n at
// (n / per_row) * stride_row + (n % per_row) * stride_slot, then hv, k, v strides.
struct DState {
  void* data = nullptr;  // null: absent
  int dtype = 0;
  std::int64_t per_row = 1, stride_row = 0, stride_slot = 0, stride_hv = 0, stride_k = 0, stride_v = 0;
};

// One segment of the plan (detail::Segment) with what its blocks need besides.
struct DSeg {
  std::int64_t batch = 0, start = 0, length = 0;
  std::int64_t state = 0;         // final-state slot
  std::int64_t init_slot = -1;    // initial-state slot, -1: zero initial state
  std::int64_t chunk_offset = 0;  // first chunk_states index of the segment (option-chunk units)
};

// One padding token row (batch, t) whose output is zero.
struct DRow {
  std::int64_t batch = 0, t = 0;
};

// Gate and beta transforms of SPEC.md 1.3.
struct DTransforms {
  int gate = 0;  // detail::GateMode: 0 log decay, 1 softplus, 2 lower-bound sigmoid
  int l2norm = 0;
  int beta_sigmoid = 0;
  float scale = 1.0f, lower_bound = 0.0f, beta_scale = 1.0f;
  DTensor A_log;    // [HV], s[0]; data null: a = 1
  DTensor dt_bias;  // s[0]: stride per value head, s[1]: per channel; data null: none
};

// The fused forward: one block per work item (segment, value head, V tile); segments are
// ordered longest first so the long ones start early.
struct FwdArgs {
  DTensor q, k, v, g, beta;  // [B, T, H|HV, K|V], beta [B, T, HV]
  DTensor o;                 // [B, T, HV, V], written
  DTransforms tr;
  DState init, fin, cs;  // initial state (any float dtype), final and chunk states (fp32)
  const DSeg* segs = nullptr;
  std::int64_t num_items = 0;  // num segments * HV * ntiles
  int K = 0, V = 0, HV = 0, group = 1;
  int C = 64;        // chunk length inside the kernel (<= the kernel's CMAX)
  int cs_every = 1;  // option chunk / C: a chunk_states entry every cs_every kernel chunks
  int ntiles = 1;    // V tiles per value head
};

// Zeroes o at the padding token rows: one block per row.
struct PadArgs {
  DTensor o;
  const DRow* rows = nullptr;
  std::int64_t num_rows = 0;
  int HV = 0, V = 0;
};

// Decode against a state pool: one block per (row, value head, V tile).
struct DecArgs {
  DTensor q, k, v, g, beta, o;  // [N, T, ...]
  DTransforms tr;
  DState pool;                          // fp32, read and written in place
  const std::int64_t* read = nullptr;   // [N] slot each row reads, -1: padding row
  const std::int64_t* write = nullptr;  // [N * T] slot the state after token t goes to, -1: none
  std::int64_t num_items = 0;           // N * HV * ntiles
  int T = 1, K = 0, V = 0, HV = 0, group = 1, ntiles = 1;
};

}  // namespace kda::cuda

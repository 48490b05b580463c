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
//   cu_seqlens   [N + 1]  int32/int64, B must be 1; non-decreasing from 0 to at most T: tokens from
//                cu_seqlens[N] to T are padding (output and gradients 0), as in FLA's graph mode
//   segment_ids  [T] or [B, T] int32, contiguous runs 1, 2, 3, ... in order; 0 = padding (anywhere: leading,
//                between segments, trailing); needs max_num_segments
// States (V-first swaps the last two dims), fp32 (initial_state: any float dtype):
//   fixed [B, HV, K, V]; cu_seqlens [N, HV, K, V]; segment_ids [B, max_num_segments, HV, K, V]
struct ForwardParams {
  TensorView q, k, v, g, beta;
  TensorView A_log, dt_bias;
  TensorView cu_seqlens, segment_ids;
  std::int64_t max_num_segments = 0;
  TensorView initial_state;  // optional
  // Optional [N] int32/int64: with it, initial_state is a state pool [slots, HV, K, V] (V-first:
  // [slots, HV, V, K]) and sequence n starts from slot initial_state_indices[n] (negative: zero
  // state), read in place without a gather copy. Not with segment_ids.
  TensorView initial_state_indices;
  TensorView o;            // required
  TensorView final_state;  // optional output
  // Optional output: the state entering every chunk, fp32 [NC, HV, K, V] (V-first: [NC, HV, V, K]),
  // NC = forward_chunk_count(params). Chunks are numbered segment by segment in plan order
  // (fixed: batch rows; cu_seqlens: segments; segment_ids: row-major over [B, max_num_segments])
  // and, inside a segment, from its first token (the chunk grid restarts at every segment).
  // This is the saved-state residual of the backward and the prefix-caching output.
  TensorView chunk_states;
  // Optional output: the delta of every token, fp32 [B, T, HV, V] (the shape of o),
  //   v_new_t = beta_t (v_t - S~_t^T k_t),  S~_t = diag(e^g_t) S_{t-1}   (SPEC.md 1.1),
  // the Vn = U - W S0 rows of the chunk form (SPEC.md 2). Padding tokens get zero rows. Given to
  // the backward with the forward's params, it replaces the W S0 product of the backward's
  // recomputation (with saved chunk_states or rematerialized states alike); FLA keeps the same
  // tensor with disable_recompute=True.
  TensorView v_new;
  Options options;
};

// Number of chunks NC of the chunk_states tensor for these params. Validates the inputs and the
// sequence description only (not o or final_state; fp64 inputs are accepted).
Status forward_chunk_count(const ForwardParams& params, std::int64_t* num_chunks);

// Gradients of the forward (SPEC.md section 2, chunk backward). `forward` holds the inputs and
// options of the forward call (its o / final_state / chunk_states outputs are not written).
// Residual policy: with `forward.chunk_states` given (the forward's saved states) they are
// reused; without, the states are rematerialized inside the backward.
//   d_o           [B, T, HV, V]   cotangent of o (any float dtype)
//   d_final_state state shape     optional cotangent of the final state
// Outputs (each optional; shapes of the matching inputs, dtype of the matching input unless noted):
//   dq, dk [B, T, H, K] (summed over value-head groups), dv, dg (w.r.t. the g argument: the
//   log decay, or the raw gate with the gate in kernel), dbeta (w.r.t. the beta argument:
//   logits with the sigmoid in kernel), dh0 (fp32, initial-state shape; equals d_final_state for
//   empty segments), dA_log [HV] and ddt_bias (dt_bias's shape) in fp32.
struct BackwardParams {
  ForwardParams forward;
  TensorView d_o, d_final_state;
  TensorView dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
};

Status chunk_backward(const BackwardParams& params);

// Checks params for chunk_backward without running it (frameworks call it before the forward).
Status validate_backward(const BackwardParams& params);

// The exact adjoint of the SPEC.md section 1 recurrence in fp64 (the backward oracle).
Status reference_backward(const BackwardParams& params);

// Decode against a state pool (SPEC.md section 3): T tokens (1, or a few draft tokens) per
// sequence, token by token, updating the pool in place. FLA's fused_recurrent_kda_fwd / vLLM's
// ssm_state_indices + num_accepted_tokens contract.
//   q, k [N, T, H, K]; v [N, T, HV, V]; g [N, T, HV, K]; beta [N, T, HV]; o [N, T, HV, V]
//   state_pool [slots, HV, K, V] (V-first: [slots, HV, V, K]), updated in place; fp32, or bf16 /
//     fp16 (CPU backend: each state read converted, computed in fp32 through the row's tokens,
//     each state written rounded to nearest even, as FLA's kernel stores narrow pools)
//   slot_indices [N] or [N, T], int32/int64:
//     [N]: sequence n reads slot s = slot_indices[n] and writes its state after the last token
//          back to s;
//     [N, T]: it reads slot slot_indices[n, a - 1] with a = num_accepted_tokens[n] (1 when not
//          given) and writes the state after token t to slot_indices[n, t] (skipped when < 0),
//          so rejected draft tokens can be rolled back.
//     A negative read slot makes row n padding: o rows are 0 and the pool is not touched.
//     [N, T'] with T' > T (vLLM's index capacity) uses the first T columns; all are range-checked.
//   num_accepted_tokens [N] int32/int64, values in [1, T]; only with [N, T] indices.
// Errors (nothing written to o or the pool): a slot index >= slots; two rows writing the same
// slot; num_accepted_tokens out of [1, T].
struct DecodeParams {
  TensorView q, k, v, g, beta;
  TensorView A_log, dt_bias;
  TensorView state_pool;
  TensorView slot_indices;
  TensorView num_accepted_tokens;
  TensorView o;
  Options options;  // path and chunk_size do not apply
};

Status decode(const DecodeParams& params);

// The chunked forward on the CPU, by options.path (fused or staged).
Status chunk_forward(const ForwardParams& params);

// The exact recurrence of SPEC.md section 1 in fp64: the oracle. Accepts fp64 inputs and
// outputs as well as the kernel dtypes. options.path, chunk_size and num_threads are ignored.
Status reference_forward(const ForwardParams& params);

// Checks params for chunk_forward without running it.
Status validate_forward(const ForwardParams& params);

}  // namespace kda

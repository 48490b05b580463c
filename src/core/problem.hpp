// The canonical form every backend and the oracle consume: validated sizes, the resolved
// options, and the segment plan (SPEC.md 1.2) built from fixed / cu_seqlens / segment_ids.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/ops.hpp"

namespace kda::detail {

enum class GateMode : std::uint8_t {
  kLogDecay,           // g is the log decay
  kSoftplus,           // g = -exp(A_log) * softplus(g + dt_bias)
  kLowerBoundSigmoid,  // g = lb * sigmoid(a * (g + dt_bias))
};

// One sequence the recurrence runs over: tokens [start, start + length) of batch row `batch`,
// reading and writing state slot `state`. Empty segments (length 0) are kept: their final
// state is their initial state (or 0).
struct Segment {
  std::int64_t batch = 0;
  std::int64_t start = 0;
  std::int64_t length = 0;
  std::int64_t state = 0;
};

// Tokens [start, end) of batch row `batch` that belong to no segment: output 0.
struct PaddingRun {
  std::int64_t batch = 0;
  std::int64_t start = 0;
  std::int64_t end = 0;
};

// Element offset of state (n, hv, kk, vv) in a state tensor: slot n = row * per_row + slot.
struct StateAddressing {
  std::int64_t per_row = 1;
  std::int64_t stride_row = 0, stride_slot = 0, stride_hv = 0, stride_k = 0, stride_v = 0;
  std::int64_t base(std::int64_t n) const { return (n / per_row) * stride_row + (n % per_row) * stride_slot; }
};

struct Problem {
  // The initial-state slot of state n: n itself, its pool slot, or -1 (start from zero).
  std::int64_t initial_slot(std::int64_t n) const { return init_slot.empty() ? n : init_slot[n]; }

  std::int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  std::int64_t group = 1;  // HV / H: value heads per q/k head
  std::int64_t num_states = 0;
  float scale = 1.0f;    // the kernels'
  double scale64 = 1.0;  // the fp64 oracle's: Options::scale (or K^-0.5) unrounded
  GateMode gate = GateMode::kLogDecay;
  float lower_bound = 0.0f;    // the kernels'
  double lower_bound64 = 0.0;  // the fp64 oracle's
  float beta_scale = 1.0f;     // c of SPEC.md 1.3
  bool beta_sigmoid = false;
  bool l2norm = false;
  int chunk = 64;
  int threads = 1;
  StateAddressing init_addr, final_addr, chunk_addr, dh0_addr;
  std::vector<Segment> segments;
  // With initial_state_indices: the pool slot of each state n (-1: zero initial state).
  std::vector<std::int64_t> init_slot;
  // Decode: the pool slot row n reads (-1: padding row) and the slot the state after token t
  // of row n is written to ([n * T + t], -1: none). Pool addressing in init_addr.
  std::vector<std::int64_t> decode_read, decode_write;
  // First chunk of each segment in the chunk_states numbering; num_chunks in all.
  std::vector<std::int64_t> chunk_offset;
  std::int64_t num_chunks = 0;
  std::vector<PaddingRun> padding;
};

// Validates every argument of a forward call and builds the plan. `oracle` relaxes the dtype
// rules (fp64 inputs/outputs) and ignores the execution options.
// `backward`: the forward part of a backward call (o and final_state are not validated and
// chunk_states is an input).
Status plan_forward(const ForwardParams& params, bool oracle, Problem* problem, bool backward = false);

// Validates a backward call (its forward part included) and builds the plan.
Status plan_backward(const BackwardParams& params, bool oracle, Problem* problem);

// Validates a decode call: its inputs as a fixed-length forward, the pool, the slot indices.
Status plan_decode(const DecodeParams& params, Problem* problem);

// Threads to use for `requested` (0 = all cores).
int resolve_threads(int requested);

}  // namespace kda::detail

// Options of the KDA operator: every switch of SPEC.md section 1 plus execution choices.
#pragma once

#include <cmath>
#include <cstdint>

namespace kda {

// Where the per-value-head state lives: [.., K, V] (K-first) or [.., V, K] (V-first: FLA
// layers, FlashKDA, vLLM, SGLang). SPEC.md 1.1.
enum class StateLayout : std::uint8_t { kKFirst, kVFirst };

// CPU execution paths (SPEC.md section 3).
enum class Path : std::uint8_t {
  kFused,   // one pass per (segment, value head), intra-chunk products in per-thread scratch
  kStaged,  // materializes intra-chunk products and per-chunk states as full tensors (baseline)
};

const char* path_name(Path path);

struct Options {
  // Query scale; NaN means the default K^-0.5. Double so that the fp64 oracle (reference_forward,
  // reference_backward) uses the value given; the kernels compute with it rounded to fp32.
  double scale = NAN;
  // SPEC.md 1.3: q, k <- x * rsqrt(sum(x^2) + 1e-6), per token, in fp32.
  bool use_qk_l2norm_in_kernel = false;
  // SPEC.md 1.3: g is the raw gate. Without lower_bound: g = -exp(A_log) * softplus(g + dt_bias)
  // (A_log required). With lower_bound: g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)).
  bool use_gate_in_kernel = false;
  bool has_lower_bound = false;
  double lower_bound = 0.0;  // must be < 0 when has_lower_bound (the kernels: rounded to fp32)
  // SPEC.md 1.3: beta = c * sigmoid(beta_raw), c = 2 with allow_neg_eigval.
  bool use_beta_sigmoid_in_kernel = false;
  bool allow_neg_eigval = false;
  int chunk_size = 64;  // 64, 32 or 16
  StateLayout state_layout = StateLayout::kKFirst;
  Path path = Path::kFused;
  int num_threads = 0;  // 0: all available cores
  // With bf16 inputs, the fused forward's three state products (W S, Qg S, Kb^T Vn) use bf16
  // dot products with fp32 accumulation where the CPU has AVX512_BF16 (the precision FLA's
  // bf16 kernels run at; o and states stay within SPEC.md 4 bounds, docs/PERF.md). The block
  // that reads a given initial state (each sequence's first 16 tokens) keeps fp32 products
  // (docs/ARCHITECTURE.md); so do heads with K or V below 16, whose few state elements average
  // none of the bf16 rounding away. false keeps every product in fp32.
  bool bf16_dot_products = true;
  // CUDA backend (docs/CUDA.md): the cudaStream_t its kernels are queued on (null: the legacy
  // default stream). The CPU backend ignores it.
  void* cuda_stream = nullptr;
};

}  // namespace kda

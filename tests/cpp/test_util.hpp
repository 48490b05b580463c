// Test support: random KDA problems, runs of the kernels and of the fp64 oracle, and the
// SPEC.md section 4 metric (rms relative error, max abs error, NaN/Inf) printed on failure.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kda/kda.hpp"

namespace kda::test {

// The compiler's own binary16 type, independent of the library's conversions (src/core/dtype.hpp):
// _Float16 on x86-64; GCC 12 for Arm has it only in C, its __fp16 (IEEE format) converts in
// hardware there.
#if defined(__x86_64__) || defined(__i386__)
using Half = _Float16;
#elif defined(__aarch64__) || defined(__arm__)
using Half = __fp16;
#else
#error "tests/cpp/test_util.hpp: no binary16 type known for this target"
#endif

enum class Gate { kLogDecay, kSoftplus, kLowerBound };

inline const char* gate_name(Gate g) {
  switch (g) {
    case Gate::kLogDecay:
      return "logdecay";
    case Gate::kSoftplus:
      return "softplus";
    case Gate::kLowerBound:
      return "lowerbound";
  }
  return "?";
}

// One forward problem. Sequences: cu_seqlens (B must be 1) or segment_ids, or fixed.
struct Case {
  std::int64_t B = 1, T = 64, H = 2, HV = 2, K = 64, V = 64;
  DType dtype = DType::kF32;
  Gate gate = Gate::kLogDecay;
  bool l2norm = true;
  bool beta_sigmoid = false;
  bool neg_eigval = false;
  bool initial_state = false;
  bool final_state = true;
  StateLayout layout = StateLayout::kKFirst;
  int chunk = 64;
  bool bf16_dot_products = true;  // Options::bf16_dot_products
  Path path = Path::kFused;
  int threads = 0;
  std::vector<std::int64_t> cu_seqlens;   // empty: not used
  std::vector<std::int32_t> segment_ids;  // empty: not used; size T ([T]) or B*T ([B, T])
  std::int64_t max_num_segments = 0;
  std::uint32_t seed = 1;
  // Extreme gates (SPEC.md 2): g = -1000 on half the entries, 0 elsewhere (log-decay mode).
  bool extreme_gates = false;
  // Strong decays (0: the default long-memory gates): log-decay mode draws g uniformly in
  // [1.5, 0.5] x gate_center (< 0); the in-kernel gates take raw gates shifted by gate_center
  // (> 0 saturates them at their lower bound).
  double gate_center = 0.0;

  std::int64_t num_states() const {
    if (!cu_seqlens.empty()) return static_cast<std::int64_t>(cu_seqlens.size()) - 1;
    if (!segment_ids.empty()) return B * max_num_segments;
    return B;
  }
  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " T=" << T << " H=" << H << " HV=" << HV << " K=" << K << " V=" << V << " " << dtype_name(dtype)
       << " gate=" << gate_name(gate) << " l2norm=" << l2norm << " beta_sigmoid=" << beta_sigmoid
       << " neg_eig=" << neg_eigval << " h0=" << initial_state << " ht=" << final_state
       << " vfirst=" << (layout == StateLayout::kVFirst) << " C=" << chunk << " path=" << path_name(path);
    if (gate_center != 0.0) os << " gate_center=" << gate_center;
    if (!cu_seqlens.empty()) {
      os << " cu_seqlens=[";
      for (auto c : cu_seqlens) os << c << ",";
      os << "]";
    }
    if (!segment_ids.empty()) os << " segment_ids(" << segment_ids.size() << ") N=" << max_num_segments;
    return os.str();
  }
};

// segment_ids (SPEC.md 1.2): runs of ids 1, 2, ... with the given lengths, then `padding` zeros.
inline std::vector<std::int32_t> id_runs(std::initializer_list<int> lengths, int padding) {
  std::vector<std::int32_t> ids;
  int id = 1;
  for (int len : lengths) {
    ids.insert(ids.end(), static_cast<std::size_t>(len), id);
    ++id;
  }
  ids.insert(ids.end(), static_cast<std::size_t>(padding), 0);
  return ids;
}

// Packed sequences (cu_seqlens with an empty one and boundaries off the chunk grid), grouped value
// heads, an initial state and every input transform: the backward's and v_new's property tests.
inline Case packed_case(DType dtype, int chunk = 64, StateLayout layout = StateLayout::kKFirst) {
  Case c;
  c.cu_seqlens = {0, 15, 100, 100, 230, 301};
  c.T = 301;
  c.H = 2, c.HV = 4, c.K = 40, c.V = 24;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  c.beta_sigmoid = true;
  c.dtype = dtype;
  c.chunk = chunk;
  c.layout = layout;
  return c;
}

// The representative options of SPEC.md 5 on one long bf16 sequence (K = V = 128, the raw gate
// with lower_bound, an initial state), with or without bf16 dot products: where the products'
// rounding could accumulate in the state.
inline Case long_bf16_case(std::int64_t T, bool bf16_dot_products) {
  Case c;
  c.T = T, c.K = 128, c.V = 128, c.H = 1, c.HV = 1;
  c.dtype = DType::kBF16;
  c.gate = Gate::kLowerBound;
  c.initial_state = true;
  c.bf16_dot_products = bf16_dot_products;
  return c;
}

// Host tensor storage in any dtype (raw bytes) with a contiguous view.
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;
  HostTensor() = default;
  HostTensor(const HostTensor& o) : bytes(o.bytes), view(o.view) { view.data = bytes.data(); }
  HostTensor(HostTensor&& o) noexcept : bytes(std::move(o.bytes)), view(o.view) { view.data = bytes.data(); }
  HostTensor& operator=(const HostTensor& o) {
    bytes = o.bytes;
    view = o.view;
    view.data = bytes.data();
    return *this;
  }
  HostTensor& operator=(HostTensor&& o) noexcept {
    bytes = std::move(o.bytes);
    view = o.view;
    view.data = bytes.data();
    return *this;
  }
  HostTensor(DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes.assign(static_cast<std::size_t>(n) * dtype_size(dtype), 0);
    view = TensorView::contiguous(bytes.data(), dtype, shape);
  }
  std::int64_t numel() const { return view.numel(); }
  void set(std::int64_t i, double x);
  double get(std::int64_t i) const;
  std::vector<double> to_double() const {
    std::vector<double> out(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) out[i] = get(i);
    return out;
  }
  void fill(double x) {
    for (std::int64_t i = 0; i < numel(); ++i) set(i, x);
  }
};

// Inputs of a case, generated deterministically from its seed.
struct Inputs {
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu, ids;
  bool has_A_log = false, has_dt_bias = false;
};

Inputs make_inputs(const Case& c);

struct Outputs {
  std::vector<double> o;      // [B, T, HV, V]
  std::vector<double> ht;     // state shape of the case, in its layout
  std::vector<double> v_new;  // [B, T, HV, V] when asked for
};

// Inputs of one sequence (B = 1, T = len, fixed length) cut from tokens [start, start + len)
// of batch row b of `in`, with initial state slot `state`.
Inputs slice_sequence(const Case& c, const Inputs& in, std::int64_t b, std::int64_t start, std::int64_t len,
                      std::int64_t state);

// Fills the forward params of a case (views into `in` and the output tensors).
ForwardParams make_params(const Case& c, const Inputs& in, HostTensor& o, HostTensor& ht);

// Runs chunk_forward (oracle=false) or reference_forward (oracle=true, fp64 outputs), with the
// v_new output when `want_v_new`.
Outputs run_forward(const Case& c, const Inputs& in, bool oracle, bool want_v_new = false);

// Backward: cotangents of o and the final state, and every gradient as doubles.
struct Cotangents {
  HostTensor d_o, dht;
};
Cotangents make_cotangents(const Case& c, std::uint32_t seed);

// What the forward keeps for the backward: its chunk states (kSaved), nothing (kRemat), or either
// plus the token deltas v_new (ForwardParams::v_new).
enum class Residuals { kSaved, kRemat, kSavedVNew, kRematVNew };
inline const char* residuals_name(Residuals r) {
  switch (r) {
    case Residuals::kSaved:
      return "saved";
    case Residuals::kRemat:
      return "remat";
    case Residuals::kSavedVNew:
      return "saved_vnew";
    case Residuals::kRematVNew:
      return "remat_vnew";
  }
  return "?";
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
};

// Runs chunk_forward (+ chunk_states and v_new as `residuals` asks) then chunk_backward, or the
// fp64 adjoint oracle. The residual comes from the forward of `producer` (the fused path unless
// told), so backward paths compared with each other start from bitwise the same residual. dh0 is requested when the
// case has an initial state or when `want_dh0`.
Grads run_backward(const Case& c, const Inputs& in, const Cotangents& ct, bool oracle,
                   Residuals residuals = Residuals::kSaved, bool want_dh0 = false, Path producer = Path::kFused);

// SPEC.md section 4 bounds for gradients.
inline double grad_bound(DType dtype, bool param_like) {
  if (dtype == DType::kF32) return 1e-4;
  return param_like ? 2e-2 : 8e-3;
}

// Asserts every gradient of the kernel backward against the oracle within the bounds.
void expect_backward_matches_oracle(const Case& c, Residuals residuals);

struct Metric {
  double rel = 0, max_abs = 0;
  bool finite = true;
  std::string str() const;
};
Metric compare(const std::vector<double>& out, const std::vector<double>& ref);

// Exact equality (NaN equals NaN), naming the first mismatch.
void expect_bitwise(const std::vector<double>& a, const std::vector<double>& b, const std::string& what);

// A flat [B * N, ...] state buffer of a segment_ids case viewed as [B, N, ...] (else unchanged).
TensorView state_view(const Case& c, const TensorView& t);

// SPEC.md section 4 bound for o and the final state.
inline double forward_bound(DType dtype) {
  return dtype == DType::kF32 ? 1e-5 : 5e-3;
}

// Asserts o and final state of the kernel against the oracle within the bound.
void expect_matches_oracle(const Case& c);

// True when KDA_LARGE_TESTS is set in the environment (the larger matrix).
bool large_tests();

}  // namespace kda::test

// Scalar forms of the input transforms of SPEC.md 1.3, templated on the compute type so the
// fp64 oracle and the fp32 kernels share one definition. Kernels use vectorized twins
// (src/cpu/simd.hpp) and are tested against these through the oracle.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.hpp"
#include "core/problem.hpp"

namespace kda::detail {

// Stable softplus: log(1 + e^x) without overflow, exact for large x.
template <typename T>
static inline T softplus(T x) {
  return (x > T(0) ? x : T(0)) + std::log1p(std::exp(-std::fabs(x)));
}

template <typename T>
static inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// x <- x * rsqrt(sum(x^2) + 1e-6)
template <typename T>
static inline void l2normalize(T* x, std::int64_t n) {
  T ss = 0;
  for (std::int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const T r = T(1) / std::sqrt(ss + T(1e-6));
  for (std::int64_t i = 0; i < n; ++i) x[i] *= r;
}

// Per-value-head gate parameters: a = exp(A_log[hv]) (1 if absent) and dt_bias[hv, :].
template <typename T>
struct GateParams {
  T a = 1;
  const void* bias = nullptr;  // dt_bias data, or null
  DType bias_dtype = DType::kF32;
  std::int64_t bias_base = 0, bias_stride = 0;  // element (hv, d) at bias_base + d * bias_stride

  T bias_at(std::int64_t d) const { return bias ? load_as<T>(bias, bias_dtype, bias_base + d * bias_stride) : T(0); }
};

template <typename T>
static inline GateParams<T> gate_params(const ForwardParams& prm, std::int64_t hv, std::int64_t K) {
  GateParams<T> gp;
  if (prm.A_log.defined()) gp.a = std::exp(load_as<T>(prm.A_log.data, prm.A_log.dtype, hv * prm.A_log.strides[0]));
  if (prm.dt_bias.defined()) {
    const TensorView& d = prm.dt_bias;
    gp.bias = d.data;
    gp.bias_dtype = d.dtype;
    if (d.ndim == 1) {
      gp.bias_base = hv * K * d.strides[0];
      gp.bias_stride = d.strides[0];
    } else {
      gp.bias_base = hv * d.strides[0];
      gp.bias_stride = d.strides[1];
    }
  }
  return gp;
}

// The log decay of channel d from the `g` argument (SPEC.md 1.3).
template <typename T>
static inline T activate_gate(const Problem& p, const GateParams<T>& gp, T raw, std::int64_t d) {
  switch (p.gate) {
    case GateMode::kLogDecay:
      return raw;
    case GateMode::kSoftplus:
      return -gp.a * softplus(raw + gp.bias_at(d));
    case GateMode::kLowerBoundSigmoid:
      return T(p.lower_bound64) * sigmoid(gp.a * (raw + gp.bias_at(d)));  // T = float: p.lower_bound
  }
  return raw;
}

template <typename T>
static inline T activate_beta(const Problem& p, T raw) {
  return p.beta_sigmoid ? T(p.beta_scale) * sigmoid(raw) : raw;
}

// The initial state of segment `seg`, value head hv, as T into S (K, V) row-major: the slot's
// state (the pool slot with initial_state_indices), or zeros.
template <typename T>
static inline void read_initial_state(const Problem& p, const ForwardParams& prm, const Segment& seg, std::int64_t hv,
                                      T* S) {
  const std::int64_t slot = p.initial_slot(seg.state);
  for (std::int64_t i = 0; i < p.K * p.V; ++i) S[i] = T(0);
  if (!prm.initial_state.defined() || slot < 0) return;
  const auto& a = p.init_addr;
  const std::int64_t base = a.base(slot) + hv * a.stride_hv;
  for (std::int64_t i = 0; i < p.K; ++i)
    for (std::int64_t j = 0; j < p.V; ++j)
      S[i * p.V + j] =
          load_as<T>(prm.initial_state.data, prm.initial_state.dtype, base + i * a.stride_k + j * a.stride_v);
}

}  // namespace kda::detail

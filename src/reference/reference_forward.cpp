// The oracle: the token-by-token recurrence of SPEC.md section 1 in fp64, with every input
// transform of SPEC.md 1.3 and the sequence semantics of SPEC.md 1.2. Deliberately simple:
// four lines per token, no chunking, so that it is obviously the specification.
#include <vector>

#include "core/dtype.hpp"
#include "core/fp_mode.hpp"
#include "core/problem.hpp"
#include "core/transforms.hpp"

namespace kda {

using detail::load_as;
using detail::store_from;

Status reference_forward(const ForwardParams& prm) {
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_forward(prm, /*oracle=*/true, &p));
  const std::int64_t K = p.K, V = p.V;
  const auto& q = prm.q;
  const auto& k = prm.k;
  const auto& v = prm.v;
  const auto& g = prm.g;
  const auto& beta = prm.beta;
  const auto& o = prm.o;
  const std::int64_t items = static_cast<std::int64_t>(p.segments.size()) * p.HV;

#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (std::int64_t item = 0; item < items; ++item) {
    const detail::ScopedIeeeMode ieee;  // core/fp_mode.hpp
    const detail::Segment& seg = p.segments[item / p.HV];
    const std::int64_t hv = item % p.HV;
    const std::int64_t h = hv / p.group;
    const auto gp = detail::gate_params<double>(prm, hv, K);
    std::vector<double> S(K * V, 0.0), qt(K), kt(K), gt(K), r(V);  // S: (K, V)
    detail::read_initial_state(p, prm, seg, hv, S.data());
    for (std::int64_t t = seg.start; t < seg.start + seg.length; ++t) {
      const std::int64_t b = seg.batch;
      if (prm.chunk_states.defined() && (t - seg.start) % p.chunk == 0) {
        const auto& a = p.chunk_addr;
        const std::int64_t base = a.base(p.chunk_offset[item / p.HV] + (t - seg.start) / p.chunk) + hv * a.stride_hv;
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < V; ++j)
            store_from<double>(prm.chunk_states.data, prm.chunk_states.dtype, base + i * a.stride_k + j * a.stride_v,
                               S[i * V + j]);
      }
      for (std::int64_t d = 0; d < K; ++d) {
        qt[d] =
            load_as<double>(q.data, q.dtype, b * q.strides[0] + t * q.strides[1] + h * q.strides[2] + d * q.strides[3]);
        kt[d] =
            load_as<double>(k.data, k.dtype, b * k.strides[0] + t * k.strides[1] + h * k.strides[2] + d * k.strides[3]);
        const double graw = load_as<double>(g.data, g.dtype,
                                            b * g.strides[0] + t * g.strides[1] + hv * g.strides[2] + d * g.strides[3]);
        gt[d] = detail::activate_gate(p, gp, graw, d);
      }
      if (p.l2norm) {
        detail::l2normalize(qt.data(), K);
        detail::l2normalize(kt.data(), K);
      }
      const double bt = detail::activate_beta(
          p, load_as<double>(beta.data, beta.dtype, b * beta.strides[0] + t * beta.strides[1] + hv * beta.strides[2]));
      // 1. decay every key row; 2. delta residual r = v - S~^T k
      for (std::int64_t i = 0; i < K; ++i) {
        const double decay = std::exp(gt[i]);
        for (std::int64_t j = 0; j < V; ++j) S[i * V + j] *= decay;
      }
      for (std::int64_t j = 0; j < V; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < K; ++i) acc += S[i * V + j] * kt[i];
        r[j] = load_as<double>(v.data, v.dtype,
                               b * v.strides[0] + t * v.strides[1] + hv * v.strides[2] + j * v.strides[3]) -
               acc;
      }
      // the token's delta v_new = beta r (ForwardParams::v_new)
      const auto& vn = prm.v_new;
      if (vn.defined())
        for (std::int64_t j = 0; j < V; ++j)
          store_from<double>(vn.data, vn.dtype,
                             b * vn.strides[0] + t * vn.strides[1] + hv * vn.strides[2] + j * vn.strides[3], bt * r[j]);
      // 3. rank-1 write; 4. readout after the write
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) S[i * V + j] += bt * kt[i] * r[j];
      for (std::int64_t j = 0; j < V; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < K; ++i) acc += S[i * V + j] * qt[i];
        store_from<double>(o.data, o.dtype, b * o.strides[0] + t * o.strides[1] + hv * o.strides[2] + j * o.strides[3],
                           acc * p.scale64);
      }
    }
    if (prm.final_state.defined()) {
      const auto& a = p.final_addr;
      const std::int64_t base = a.base(seg.state) + hv * a.stride_hv;
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j)
          store_from<double>(prm.final_state.data, prm.final_state.dtype, base + i * a.stride_k + j * a.stride_v,
                             S[i * V + j]);
    }
  }
  // Padding tokens: output 0 (SPEC.md 1.2), and v_new 0.
  for (const TensorView* out : {&o, &prm.v_new}) {
    if (!out->defined()) continue;
    const TensorView& x = *out;
    for (const auto& pad : p.padding)
      for (std::int64_t t = pad.start; t < pad.end; ++t)
        for (std::int64_t hv = 0; hv < p.HV; ++hv)
          for (std::int64_t j = 0; j < V; ++j)
            store_from<double>(x.data, x.dtype,
                               pad.batch * x.strides[0] + t * x.strides[1] + hv * x.strides[2] + j * x.strides[3], 0.0);
  }
  return {};
}

Status validate_forward(const ForwardParams& prm) {
  detail::Problem p;
  return detail::plan_forward(prm, /*oracle=*/false, &p);
}

}  // namespace kda

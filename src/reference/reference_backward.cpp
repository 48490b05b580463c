// The backward oracle: the exact adjoint of the SPEC.md section 1 recurrence in fp64, token by
// token in reverse, through every input transform of SPEC.md 1.3. States are recomputed from
// checkpoints every kCheckpoint tokens, so memory stays O(T / kCheckpoint * K * V).
// Checked itself against central finite differences (tests/cpp/test_backward_oracle.cpp).
#include <vector>

#include "core/dtype.hpp"
#include "core/fp_mode.hpp"
#include "core/problem.hpp"
#include "core/transforms.hpp"

namespace kda {
namespace {

using detail::load_as;
using detail::store_from;

constexpr std::int64_t kCheckpoint = 64;

std::int64_t off4(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
  return b * t.strides[0] + s * t.strides[1] + h * t.strides[2] + d * t.strides[3];
}

// One token's transformed inputs and what the chain rule needs of the raw ones.
struct Token {
  std::vector<double> q, k, qraw, kraw, g, graw;  // (K)
  std::vector<double> v;                          // (V)
  double beta = 0, braw = 0;
};

struct Ctx {
  const detail::Problem& p;
  const ForwardParams& f;
  const detail::GateParams<double> gp;
};

void load_token(const Ctx& c, std::int64_t b, std::int64_t t, std::int64_t hv, Token& tk) {
  const detail::Problem& p = c.p;
  const ForwardParams& f = c.f;
  const std::int64_t h = hv / p.group;
  tk.q.resize(p.K), tk.k.resize(p.K), tk.qraw.resize(p.K), tk.kraw.resize(p.K), tk.g.resize(p.K), tk.graw.resize(p.K);
  tk.v.resize(p.V);
  for (std::int64_t d = 0; d < p.K; ++d) {
    tk.qraw[d] = load_as<double>(f.q.data, f.q.dtype, off4(f.q, b, t, h, d));
    tk.kraw[d] = load_as<double>(f.k.data, f.k.dtype, off4(f.k, b, t, h, d));
    tk.graw[d] = load_as<double>(f.g.data, f.g.dtype, off4(f.g, b, t, hv, d));
    tk.g[d] = detail::activate_gate(p, c.gp, tk.graw[d], d);
  }
  tk.q = tk.qraw;
  tk.k = tk.kraw;
  if (p.l2norm) {
    detail::l2normalize(tk.q.data(), p.K);
    detail::l2normalize(tk.k.data(), p.K);
  }
  for (std::int64_t j = 0; j < p.V; ++j) tk.v[j] = load_as<double>(f.v.data, f.v.dtype, off4(f.v, b, t, hv, j));
  tk.braw = load_as<double>(f.beta.data, f.beta.dtype,
                            b * f.beta.strides[0] + t * f.beta.strides[1] + hv * f.beta.strides[2]);
  tk.beta = detail::activate_beta(p, tk.braw);
}

// S <- the state after token tk (SPEC.md section 1, lines 1-3).
void step(std::int64_t K, std::int64_t V, const Token& tk, double* S) {
  std::vector<double> r(V);
  for (std::int64_t i = 0; i < K; ++i) {
    const double e = std::exp(tk.g[i]);
    for (std::int64_t j = 0; j < V; ++j) S[i * V + j] *= e;
  }
  for (std::int64_t j = 0; j < V; ++j) {
    double acc = 0;
    for (std::int64_t i = 0; i < K; ++i) acc += S[i * V + j] * tk.k[i];
    r[j] = tk.v[j] - acc;
  }
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) S[i * V + j] += tk.beta * tk.k[i] * r[j];
}

// d x from d x_hat through x_hat = x * rsqrt(|x|^2 + 1e-6).
void l2norm_backward(const std::vector<double>& x, std::vector<double>& dx) {
  double ss = 0, dot = 0;
  for (std::size_t i = 0; i < x.size(); ++i) ss += x[i] * x[i];
  const double r = 1.0 / std::sqrt(ss + 1e-6);
  for (std::size_t i = 0; i < x.size(); ++i) dot += x[i] * r * dx[i];
  for (std::size_t i = 0; i < x.size(); ++i) dx[i] = r * (dx[i] - x[i] * r * dot);
}

}  // namespace

Status reference_backward(const BackwardParams& prm) {
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_backward(prm, /*oracle=*/true, &p));
  const ForwardParams& f = prm.forward;
  const std::int64_t K = p.K, V = p.V, KV = K * V;
  const std::int64_t nseg = static_cast<std::int64_t>(p.segments.size());
  const std::int64_t items = nseg * p.H;
  const bool kfirst = f.options.state_layout == StateLayout::kKFirst;
  // Reads element (i, j) of state slot n, head hv of a state tensor in the call's layout.
  auto state_index = [&](const TensorView& t, std::int64_t n, std::int64_t hv, std::int64_t i, std::int64_t j) {
    const int nd = t.ndim;
    std::int64_t base;
    if (nd == 5) {
      base = (n / f.max_num_segments) * t.strides[0] + (n % f.max_num_segments) * t.strides[1];
    } else {
      base = n * t.strides[0];
    }
    base += hv * t.strides[nd - 3];
    return kfirst ? base + i * t.strides[nd - 2] + j * t.strides[nd - 1]
                  : base + j * t.strides[nd - 2] + i * t.strides[nd - 1];
  };
  std::vector<double> dA_log(p.HV, 0.0), ddt_bias(p.HV * K, 0.0);

#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
  for (std::int64_t item = 0; item < items; ++item) {
    const detail::ScopedIeeeMode ieee;  // core/fp_mode.hpp
    const detail::Segment& seg = p.segments[item / p.H];
    const std::int64_t h = item % p.H, b = seg.batch, L = seg.length;
    std::vector<double> dq_acc(L * K, 0.0), dk_acc(L * K, 0.0);  // summed over the group
    std::vector<double> dA_item(p.HV, 0.0), ddt_item(p.HV * K, 0.0);
    for (std::int64_t hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
      const Ctx c{p, f, detail::gate_params<double>(f, hv, K)};
      std::vector<double> S(KV, 0.0);
      detail::read_initial_state(p, f, seg, hv, S.data());
      // Checkpoints: the state before tokens 0, kCheckpoint, 2 kCheckpoint, ...
      const std::int64_t ncp = (L + kCheckpoint - 1) / kCheckpoint;
      std::vector<double> cps(static_cast<std::size_t>(ncp * KV));
      Token tk;
      for (std::int64_t t = 0; t < L; ++t) {
        if (t % kCheckpoint == 0) std::copy(S.begin(), S.end(), cps.begin() + (t / kCheckpoint) * KV);
        load_token(c, b, seg.start + t, hv, tk);
        step(K, V, tk, S.data());
      }
      std::vector<double> dS(KV, 0.0);
      if (prm.d_final_state.defined())
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < V; ++j)
            dS[i * V + j] = load_as<double>(prm.d_final_state.data, prm.d_final_state.dtype,
                                            state_index(prm.d_final_state, seg.state, hv, i, j));
      std::vector<double> states((kCheckpoint + 1) * KV), Sd(KV), r(V), dq(K), dk(K), dr(V), dgam(K), dO(V);
      for (std::int64_t cp = ncp - 1; cp >= 0; --cp) {
        const std::int64_t t0 = cp * kCheckpoint, t1 = std::min(L, t0 + kCheckpoint);
        std::copy(cps.begin() + cp * KV, cps.begin() + (cp + 1) * KV, states.begin());
        for (std::int64_t t = t0; t < t1; ++t) {
          load_token(c, b, seg.start + t, hv, tk);
          double* next = states.data() + (t - t0 + 1) * KV;
          std::copy(next - KV, next, next);
          step(K, V, tk, next);
        }
        for (std::int64_t t = t1 - 1; t >= t0; --t) {
          load_token(c, b, seg.start + t, hv, tk);
          const double* Sprev = states.data() + (t - t0) * KV;
          const double* Snew = states.data() + (t - t0 + 1) * KV;
          for (std::int64_t j = 0; j < V; ++j)
            dO[j] = load_as<double>(prm.d_o.data, prm.d_o.dtype, off4(prm.d_o, b, seg.start + t, hv, j));
          // Decayed state S~ and the residual r = v - S~^T k.
          for (std::int64_t i = 0; i < K; ++i) {
            const double e = std::exp(tk.g[i]);
            for (std::int64_t j = 0; j < V; ++j) Sd[i * V + j] = Sprev[i * V + j] * e;
          }
          for (std::int64_t j = 0; j < V; ++j) {
            double acc = 0;
            for (std::int64_t i = 0; i < K; ++i) acc += Sd[i * V + j] * tk.k[i];
            r[j] = tk.v[j] - acc;
          }
          // 4. o = scale S^T q
          const double scale = p.scale64;
          for (std::int64_t i = 0; i < K; ++i) {
            double acc = 0;
            for (std::int64_t j = 0; j < V; ++j) {
              dS[i * V + j] += scale * tk.q[i] * dO[j];
              acc += Snew[i * V + j] * dO[j];
            }
            dq[i] = scale * acc;
          }
          // 3. S = S~ + beta k r^T
          double dbeta = 0;
          for (std::int64_t i = 0; i < K; ++i) {
            double acc = 0;
            for (std::int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * r[j];
            dbeta += tk.k[i] * acc;
            dk[i] = tk.beta * acc;
          }
          for (std::int64_t j = 0; j < V; ++j) {
            double acc = 0;
            for (std::int64_t i = 0; i < K; ++i) acc += dS[i * V + j] * tk.k[i];
            dr[j] = tk.beta * acc;
          }
          // 2. r = v - S~^T k: dv = dr, dS~ = dS - k dr^T, dk -= S~ dr
          for (std::int64_t i = 0; i < K; ++i) {
            double acc = 0;
            for (std::int64_t j = 0; j < V; ++j) {
              acc += Sd[i * V + j] * dr[j];
              dS[i * V + j] -= tk.k[i] * dr[j];
            }
            dk[i] -= acc;
          }
          // 1. S~ = diag(e^g) S_prev
          for (std::int64_t i = 0; i < K; ++i) {
            const double e = std::exp(tk.g[i]);
            double acc = 0;
            for (std::int64_t j = 0; j < V; ++j) {
              acc += Sprev[i * V + j] * dS[i * V + j];
              dS[i * V + j] *= e;
            }
            dgam[i] = e * acc;
          }
          // Input transforms (SPEC.md 1.3).
          if (p.l2norm) {
            l2norm_backward(tk.qraw, dq);
            l2norm_backward(tk.kraw, dk);
          }
          for (std::int64_t i = 0; i < K; ++i) {
            dq_acc[t * K + i] += dq[i];
            dk_acc[t * K + i] += dk[i];
          }
          const std::int64_t tt = seg.start + t;
          for (std::int64_t j = 0; j < V; ++j)
            if (prm.dv.defined()) store_from<double>(prm.dv.data, prm.dv.dtype, off4(prm.dv, b, tt, hv, j), dr[j]);
          for (std::int64_t i = 0; i < K; ++i) {
            double dgraw = dgam[i];
            if (p.gate != detail::GateMode::kLogDecay) {
              const double x = tk.graw[i] + c.gp.bias_at(i);
              double dx, da;  // d gamma / d x, d gamma / d A_log
              if (p.gate == detail::GateMode::kSoftplus) {
                dx = -c.gp.a * detail::sigmoid(x);
                da = tk.g[i];
              } else {
                const double z = c.gp.a * x;
                dx = p.lower_bound64 * detail::sigmoid(z) * detail::sigmoid(-z) * c.gp.a;
                da = dx * x;
              }
              dgraw = dgam[i] * dx;
              dA_item[hv] += dgam[i] * da;
              ddt_item[hv * K + i] += dgraw;
            }
            if (prm.dg.defined()) store_from<double>(prm.dg.data, prm.dg.dtype, off4(prm.dg, b, tt, hv, i), dgraw);
          }
          if (p.beta_sigmoid) {
            dbeta *= p.beta_scale * detail::sigmoid(tk.braw) * detail::sigmoid(-tk.braw);
          }
          if (prm.dbeta.defined())
            store_from<double>(prm.dbeta.data, prm.dbeta.dtype,
                               b * prm.dbeta.strides[0] + tt * prm.dbeta.strides[1] + hv * prm.dbeta.strides[2], dbeta);
        }
      }
      if (prm.dh0.defined())
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < V; ++j)
            store_from<double>(prm.dh0.data, prm.dh0.dtype, state_index(prm.dh0, seg.state, hv, i, j), dS[i * V + j]);
    }
    for (std::int64_t t = 0; t < L; ++t)
      for (std::int64_t i = 0; i < K; ++i) {
        if (prm.dq.defined())
          store_from<double>(prm.dq.data, prm.dq.dtype, off4(prm.dq, b, seg.start + t, h, i), dq_acc[t * K + i]);
        if (prm.dk.defined())
          store_from<double>(prm.dk.data, prm.dk.dtype, off4(prm.dk, b, seg.start + t, h, i), dk_acc[t * K + i]);
      }
#pragma omp critical(kda_reference_backward_params)
    {
      for (std::int64_t i = 0; i < p.HV; ++i) dA_log[i] += dA_item[i];
      for (std::int64_t i = 0; i < p.HV * K; ++i) ddt_bias[i] += ddt_item[i];
    }
  }
  // Padding tokens: exactly zero gradients (SPEC.md 1.2).
  for (const auto& pad : p.padding)
    for (std::int64_t t = pad.start; t < pad.end; ++t) {
      for (std::int64_t h = 0; h < p.H; ++h)
        for (std::int64_t i = 0; i < K; ++i) {
          if (prm.dq.defined()) store_from<double>(prm.dq.data, prm.dq.dtype, off4(prm.dq, pad.batch, t, h, i), 0.0);
          if (prm.dk.defined()) store_from<double>(prm.dk.data, prm.dk.dtype, off4(prm.dk, pad.batch, t, h, i), 0.0);
        }
      for (std::int64_t hv = 0; hv < p.HV; ++hv) {
        for (std::int64_t j = 0; j < V; ++j)
          if (prm.dv.defined()) store_from<double>(prm.dv.data, prm.dv.dtype, off4(prm.dv, pad.batch, t, hv, j), 0.0);
        for (std::int64_t i = 0; i < K; ++i)
          if (prm.dg.defined()) store_from<double>(prm.dg.data, prm.dg.dtype, off4(prm.dg, pad.batch, t, hv, i), 0.0);
        if (prm.dbeta.defined())
          store_from<double>(prm.dbeta.data, prm.dbeta.dtype,
                             pad.batch * prm.dbeta.strides[0] + t * prm.dbeta.strides[1] + hv * prm.dbeta.strides[2],
                             0.0);
      }
    }
  if (prm.dA_log.defined())
    for (std::int64_t i = 0; i < p.HV; ++i)
      store_from<double>(prm.dA_log.data, prm.dA_log.dtype, i * prm.dA_log.strides[0], dA_log[i]);
  if (prm.ddt_bias.defined()) {
    const TensorView& d = prm.ddt_bias;
    for (std::int64_t hv = 0; hv < p.HV; ++hv)
      for (std::int64_t i = 0; i < K; ++i) {
        const std::int64_t off = d.ndim == 1 ? (hv * K + i) * d.strides[0] : hv * d.strides[0] + i * d.strides[1];
        store_from<double>(d.data, d.dtype, off, ddt_bias[hv * K + i]);
      }
  }
  return {};
}

}  // namespace kda

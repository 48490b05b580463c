// The fp64 adjoint oracle checked against central finite differences of the fp64 forward
// oracle (SPEC.md section 4: "the backward oracle must itself pass a finite-difference check").
// Loss = sum(o * d_o) + sum(final_state * d_final_state).
#include "test_util.hpp"

namespace kda::test {
namespace {

double loss(const Case& c, const Inputs& in, const Cotangents& ct) {
  const Outputs out = run_forward(c, in, /*oracle=*/true);
  double l = 0;
  for (std::int64_t i = 0; i < ct.d_o.numel(); ++i) l += out.o[i] * ct.d_o.get(i);
  if (c.final_state)
    for (std::int64_t i = 0; i < ct.dht.numel(); ++i) l += out.ht[i] * ct.dht.get(i);
  return l;
}

struct FdCase {
  const char* name;
  Gate gate;
  bool l2norm, beta_sigmoid, neg_eig;
  std::int64_t H, HV;
  bool varlen;
};

const FdCase kFdCases[] = {
    {"logdecay", Gate::kLogDecay, false, false, false, 1, 1, false},
    {"softplus_l2norm_grouped", Gate::kSoftplus, true, false, false, 1, 2, false},
    {"lowerbound_beta_sigmoid", Gate::kLowerBound, true, true, true, 2, 2, false},
    {"varlen_empty_segment", Gate::kSoftplus, false, true, false, 1, 1, true},
};

class AdjointOracle : public ::testing::TestWithParam<FdCase> {};

TEST_P(AdjointOracle, MatchesCentralFiniteDifferences) {
  const FdCase& fc = GetParam();
  Case c;
  c.dtype = DType::kF64;
  c.T = 9, c.K = 5, c.V = 4, c.H = fc.H, c.HV = fc.HV;
  c.gate = fc.gate, c.l2norm = fc.l2norm, c.beta_sigmoid = fc.beta_sigmoid, c.neg_eigval = fc.neg_eig;
  c.initial_state = true;
  if (fc.varlen) c.cu_seqlens = {0, 4, 4, 9};
  Inputs in = make_inputs(c);
  // fp64 state buffers for the oracle.
  HostTensor h0(DType::kF64, {c.num_states(), c.HV, c.K, c.V});
  for (std::int64_t i = 0; i < h0.numel(); ++i) h0.set(i, in.h0.get(i));
  in.h0 = h0;
  if (in.has_A_log) {
    HostTensor a(DType::kF64, {c.HV}), d(DType::kF64, {c.HV * c.K});
    for (std::int64_t i = 0; i < a.numel(); ++i) a.set(i, in.A_log.get(i));
    for (std::int64_t i = 0; i < d.numel(); ++i) d.set(i, in.dt_bias.get(i));
    in.A_log = a, in.dt_bias = d;
  }
  Cotangents ct = make_cotangents(c, 3);
  HostTensor dht(DType::kF64, {c.num_states(), c.HV, c.K, c.V});
  for (std::int64_t i = 0; i < dht.numel(); ++i) dht.set(i, ct.dht.get(i));
  ct.dht = dht;
  const Grads g = run_backward(c, in, ct, /*oracle=*/true);
  struct Target {
    const char* name;
    HostTensor* x;
    const std::vector<double>* grad;
  };
  std::vector<Target> targets = {{"q", &in.q, &g.dq}, {"k", &in.k, &g.dk},          {"v", &in.v, &g.dv},
                                 {"g", &in.g, &g.dg}, {"beta", &in.beta, &g.dbeta}, {"h0", &in.h0, &g.dh0}};
  if (in.has_A_log) {
    targets.push_back({"A_log", &in.A_log, &g.dA_log});
    targets.push_back({"dt_bias", &in.dt_bias, &g.ddt_bias});
  }
  const double eps = 1e-6;
  for (const Target& t : targets) {
    double max_err = 0, max_grad = 0;
    for (std::int64_t i = 0; i < t.x->numel(); ++i) {
      const double x0 = t.x->get(i);
      t.x->set(i, x0 + eps);
      const double lp = loss(c, in, ct);
      t.x->set(i, x0 - eps);
      const double lm = loss(c, in, ct);
      t.x->set(i, x0);
      const double fd = (lp - lm) / (2 * eps);
      max_err = std::max(max_err, std::fabs(fd - (*t.grad)[i]));
      max_grad = std::max(max_grad, std::fabs(fd));
    }
    EXPECT_LE(max_err, 1e-6 * std::max(1.0, max_grad)) << "d" << t.name << ": max |fd - adjoint| = " << max_err
                                                       << ", max |grad| = " << max_grad << " (" << fc.name << ")";
    EXPECT_GT(max_grad, 0.0) << "d" << t.name << " is identically zero: the check would be vacuous";
  }
}

INSTANTIATE_TEST_SUITE_P(Backward, AdjointOracle, ::testing::ValuesIn(kFdCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kda::test

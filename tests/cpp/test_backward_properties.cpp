// Exact contracts of the backward, asserted bitwise: saved-state vs rematerialized gradients,
// packed vs per-sequence gradients, zero gradients on padding, dh0 = dht on empty segments,
// reverse causality, segment isolation; packed sequences and extreme parameters vs the oracle.
#include <limits>

#include "test_util.hpp"

namespace kda::test {
namespace {

std::vector<double> token_rows(const std::vector<double>& x, std::int64_t T, std::int64_t b, std::int64_t t0,
                               std::int64_t t1, std::int64_t B) {
  const std::int64_t row = static_cast<std::int64_t>(x.size()) / (B * T);
  return {x.begin() + (b * T + t0) * row, x.begin() + (b * T + t1) * row};
}

class SavedVsRemat : public ::testing::TestWithParam<DType> {};

// Both policies run the same chunk arithmetic on the same entering states.
TEST_P(SavedVsRemat, SameGradientsBitwise) {
  const Case c = packed_case(GetParam());
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 4);
  const Grads saved = run_backward(c, in, ct, false, Residuals::kSaved);
  const Grads remat = run_backward(c, in, ct, false, Residuals::kRemat);
  expect_bitwise(saved.dq, remat.dq, "dq");
  expect_bitwise(saved.dk, remat.dk, "dk");
  expect_bitwise(saved.dv, remat.dv, "dv");
  expect_bitwise(saved.dg, remat.dg, "dg");
  expect_bitwise(saved.dbeta, remat.dbeta, "dbeta");
  expect_bitwise(saved.dh0, remat.dh0, "dh0");
}

INSTANTIATE_TEST_SUITE_P(BackwardExact, SavedVsRemat, ::testing::Values(DType::kF32, DType::kBF16));

TEST(BackwardExact, PackedGradientsEqualPerSequenceGradientsBitwise) {
  const Case c = packed_case(DType::kF32);
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 5);
  const Grads packed = run_backward(c, in, ct, false);
  for (std::size_t s = 0; s + 1 < c.cu_seqlens.size(); ++s) {
    const std::int64_t start = c.cu_seqlens[s], len = c.cu_seqlens[s + 1] - start;
    Case one = c;
    one.cu_seqlens.clear();
    one.T = len;
    const Inputs sub = slice_sequence(c, in, 0, start, len, static_cast<std::int64_t>(s));
    Cotangents sct = make_cotangents(one, 0);
    const std::size_t orow = static_cast<std::size_t>(c.HV * c.V) * dtype_size(c.dtype);
    if (len > 0) std::memcpy(sct.d_o.bytes.data(), ct.d_o.bytes.data() + start * orow, len * orow);
    const std::size_t slot = sct.dht.bytes.size();
    std::memcpy(sct.dht.bytes.data(), ct.dht.bytes.data() + s * slot, slot);
    const Grads alone = run_backward(one, sub, sct, false);
    const std::string tag = " of segment " + std::to_string(s);
    expect_bitwise(token_rows(packed.dq, c.T, 0, start, start + len, 1), alone.dq, "dq" + tag);
    expect_bitwise(token_rows(packed.dk, c.T, 0, start, start + len, 1), alone.dk, "dk" + tag);
    expect_bitwise(token_rows(packed.dv, c.T, 0, start, start + len, 1), alone.dv, "dv" + tag);
    expect_bitwise(token_rows(packed.dg, c.T, 0, start, start + len, 1), alone.dg, "dg" + tag);
    expect_bitwise(token_rows(packed.dbeta, c.T, 0, start, start + len, 1), alone.dbeta, "dbeta" + tag);
    const std::int64_t n = c.HV * c.K * c.V;
    expect_bitwise({packed.dh0.begin() + s * n, packed.dh0.begin() + (s + 1) * n}, alone.dh0, "dh0" + tag);
  }
}

TEST(BackwardExact, EmptySegmentsGiveDh0EqualToDht) {
  const Case c = packed_case(DType::kF32);  // segment 2 is empty
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 6);
  for (Residuals r : {Residuals::kSaved, Residuals::kRemat}) {
    const Grads g = run_backward(c, in, ct, false, r);
    const std::int64_t n = c.HV * c.K * c.V;
    const auto dht = ct.dht.to_double();
    expect_bitwise({g.dh0.begin() + 2 * n, g.dh0.begin() + 3 * n}, {dht.begin() + 2 * n, dht.begin() + 3 * n}, "dh0");
  }
  Case no_ht = c;
  no_ht.final_state = false;
  const Grads g = run_backward(no_ht, in, ct, false);
  const std::int64_t n = c.HV * c.K * c.V;
  for (std::int64_t i = 2 * n; i < 3 * n; ++i) ASSERT_EQ(g.dh0[i], 0.0) << "dh0 of an empty segment without dht";
}

TEST(BackwardExact, PaddingTokensGetExactlyZeroGradients) {
  Case c;
  c.T = 90, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.B = 2;
  // Padding leads the row, sits between the segments and ends it.
  c.segment_ids.assign(6, 0);
  c.segment_ids.resize(60, 1);
  c.segment_ids.resize(64, 0);
  c.segment_ids.resize(70, 2);
  c.segment_ids.resize(90, 0);
  c.max_num_segments = 3;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 7);
  for (Residuals r : {Residuals::kSaved, Residuals::kRemat}) {
    const Grads g = run_backward(c, in, ct, false, r);  // outputs start at 12345: zeros were written
    for (std::int64_t b = 0; b < 2; ++b)
      for (const auto [t0, t1] : {std::pair<std::int64_t, std::int64_t>{0, 6}, {60, 64}, {70, 90}})
        for (const auto* x : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta})
          for (double v : token_rows(*x, c.T, b, t0, t1, 2)) ASSERT_EQ(v, 0.0) << "token range " << t0 << ".." << t1;
    // The unused slot 3 is an empty segment: dh0 = dht.
    const auto dht = ct.dht.to_double();
    const std::int64_t n = c.HV * c.K * c.V;
    expect_bitwise({g.dh0.begin() + 2 * n, g.dh0.begin() + 3 * n}, {dht.begin() + 2 * n, dht.begin() + 3 * n},
                   "dh0 slot 3");
  }
  // And the real tokens match the oracle.
  expect_backward_matches_oracle(c, Residuals::kSaved);
}

TEST(BackwardExact, TokensAfterCuSeqlensGetExactlyZeroGradients) {
  Case c;
  c.T = 100, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.cu_seqlens = {0, 37, 37, 71};  // 29 tokens after the last sequence
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 11);
  for (Residuals r : {Residuals::kSaved, Residuals::kRemat}) {
    const Grads g = run_backward(c, in, ct, false, r);  // outputs start at 12345: zeros were written
    for (const auto* x : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta})
      for (double v : token_rows(*x, c.T, 0, 71, 100, 1)) ASSERT_EQ(v, 0.0);
  }
  expect_backward_matches_oracle(c, Residuals::kSaved);
}

// Perturbing d_o at token t leaves the gradients of every input after t bitwise unchanged.
class ReverseCausality : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(ReverseCausality, LaterGradientsIgnoreEarlierCotangents) {
  const std::int64_t t = GetParam();
  Case c;
  c.T = 150, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.gate = Gate::kSoftplus;
  c.final_state = true;
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 8);
  const Grads base = run_backward(c, in, ct, false);
  Cotangents changed = ct;
  const std::int64_t row = c.HV * c.V;
  for (std::int64_t i = 0; i < (t + 1) * row; ++i) changed.d_o.set(i, ct.d_o.get(i) * -3.0 + 0.5);
  const Grads after = run_backward(c, in, changed, false);
  for (const auto& [name, a, b] : {std::tuple{"dq", &base.dq, &after.dq}, std::tuple{"dk", &base.dk, &after.dk},
                                   std::tuple{"dv", &base.dv, &after.dv}, std::tuple{"dg", &base.dg, &after.dg},
                                   std::tuple{"dbeta", &base.dbeta, &after.dbeta}}) {
    expect_bitwise(token_rows(*a, c.T, 0, t + 1, c.T, 1), token_rows(*b, c.T, 0, t + 1, c.T, 1),
                   std::string(name) + " after t=" + std::to_string(t));
  }
  EXPECT_NE(token_rows(base.dv, c.T, 0, t, t + 1, 1), token_rows(after.dv, c.T, 0, t, t + 1, 1))
      << "the change must reach dv[t]; the test would be vacuous otherwise";
}

INSTANTIATE_TEST_SUITE_P(BackwardExact, ReverseCausality,
                         ::testing::Values<std::int64_t>(0, 15, 16, 40, 63, 64, 100, 148));

TEST(BackwardExact, SegmentIsolationUnderNaN) {
  Case c = packed_case(DType::kF32);
  c.gate = Gate::kLogDecay;  // dA_log / ddt_bias legitimately sum over all segments
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 9);
  const Grads base = run_backward(c, in, ct, false);
  Inputs bad = in;
  const std::int64_t s1 = c.cu_seqlens[1], s2 = c.cu_seqlens[2];
  for (HostTensor* x : {&bad.q, &bad.k, &bad.v, &bad.g, &bad.beta}) {
    const std::int64_t row = x->numel() / c.T;
    for (std::int64_t i = s1 * row; i < s2 * row; i += 5) x->set(i, std::nan(""));
  }
  const Grads after = run_backward(c, bad, ct, false);
  const std::pair<const std::vector<double>*, const std::vector<double>*> grads[] = {{&base.dq, &after.dq},
                                                                                     {&base.dk, &after.dk},
                                                                                     {&base.dv, &after.dv},
                                                                                     {&base.dg, &after.dg},
                                                                                     {&base.dbeta, &after.dbeta}};
  for (const auto& [a, b] : grads) {
    expect_bitwise(token_rows(*a, c.T, 0, 0, s1, 1), token_rows(*b, c.T, 0, 0, s1, 1), "segment 0");
    expect_bitwise(token_rows(*a, c.T, 0, s2, c.T, 1), token_rows(*b, c.T, 0, s2, c.T, 1), "segments after 1");
  }
}

struct VarlenBwd {
  const char* name;
  std::vector<std::int64_t> cu;
};

class BackwardVarlen : public ::testing::TestWithParam<std::tuple<VarlenBwd, DType, Residuals>> {};

TEST_P(BackwardVarlen, MatchesAdjointOracle) {
  const auto [vc, dtype, residuals] = GetParam();
  Case c;
  c.cu_seqlens = vc.cu;
  c.T = vc.cu.back();
  c.H = 1, c.HV = 2, c.K = 32, c.V = 48;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  c.dtype = dtype;
  expect_backward_matches_oracle(c, residuals);
}

INSTANTIATE_TEST_SUITE_P(
    BackwardVarlen, BackwardVarlen,
    ::testing::Combine(::testing::Values(VarlenBwd{"three_unaligned", {0, 256, 500, 1000}},
                                         VarlenBwd{"five_mixed", {0, 15, 100, 300, 1200, 2000}},
                                         VarlenBwd{"lengths_1_to_8", {0, 1, 3, 6, 10, 15, 21, 28, 36}},
                                         VarlenBwd{"empty_segments", {0, 0, 10, 10, 75, 75, 140}}),
                       ::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(Residuals::kSaved, Residuals::kRemat, Residuals::kRematVNew)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) + "_" + dtype_name(std::get<1>(info.param)) + "_" +
             residuals_name(std::get<2>(info.param));
    });

TEST(BackwardVarlenIds, BroadcastSegmentMapOverBatch) {
  Case c;
  c.B = 3, c.T = 90, c.H = 1, c.HV = 1, c.K = 24, c.V = 40;
  c.segment_ids.assign(17, 1);
  c.segment_ids.resize(57, 2);
  c.segment_ids.resize(77, 3);
  c.segment_ids.resize(90, 0);
  c.max_num_segments = 4;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  expect_backward_matches_oracle(c, Residuals::kRemat);
}

// No NaN at extreme parameters: g = -1000 on half the entries; a saturated gate sigmoid with a
// huge exp(A_log); a softplus gate with huge decay.
TEST(BackwardNumerics, ExtremeLogDecay) {
  Case c;
  c.T = 150, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
  c.extreme_gates = true;
  c.initial_state = true;
  expect_backward_matches_oracle(c, Residuals::kSaved);
  c.chunk = 16;
  expect_backward_matches_oracle(c, Residuals::kRemat);
}

// g = -inf (a hard reset) and g = -1e20 on some entries: every gradient finite and within the
// fp32 bounds of the oracle (the exact derivative through e^g = 0 is 0).
TEST(BackwardNumerics, InfiniteLogDecay) {
  for (double value : {-std::numeric_limits<double>::infinity(), -1e20}) {
    Case c;
    c.T = 150, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
    c.initial_state = true;
    Inputs in = make_inputs(c);
    std::mt19937 rng(11);
    for (std::int64_t i = 0; i < in.g.numel(); ++i)
      if (rng() % 50 == 0) in.g.set(i, value);
    const Cotangents ct = make_cotangents(c, 13);
    const Grads ref = run_backward(c, in, ct, true);
    for (Residuals r : {Residuals::kSaved, Residuals::kRemat}) {
      const Grads out = run_backward(c, in, ct, false, r);
      for (const auto& [name, a, b] :
           {std::tuple{"dq", &out.dq, &ref.dq}, std::tuple{"dk", &out.dk, &ref.dk}, std::tuple{"dv", &out.dv, &ref.dv},
            std::tuple{"dg", &out.dg, &ref.dg}, std::tuple{"dbeta", &out.dbeta, &ref.dbeta},
            std::tuple{"dh0", &out.dh0, &ref.dh0}}) {
        const Metric m = compare(*a, *b);
        EXPECT_TRUE(m.finite && m.rel <= 1e-4) << name << " g=" << value << ": " << m.str();
      }
    }
  }
}

TEST(BackwardNumerics, HugeALogSaturatesTheGate) {
  for (Gate gate : {Gate::kLowerBound, Gate::kSoftplus}) {
    Case c;
    c.T = 100, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
    c.gate = gate;
    c.initial_state = true;
    Inputs in = make_inputs(c);
    in.A_log.fill(10.0);  // exp(A_log) ~ 22026
    const Cotangents ct = make_cotangents(c, 12);
    const Grads ref = run_backward(c, in, ct, true);
    const Grads out = run_backward(c, in, ct, false);
    for (const auto& [name, a, b] :
         {std::tuple{"dq", &out.dq, &ref.dq}, std::tuple{"dk", &out.dk, &ref.dk}, std::tuple{"dv", &out.dv, &ref.dv},
          std::tuple{"dg", &out.dg, &ref.dg}, std::tuple{"dbeta", &out.dbeta, &ref.dbeta},
          std::tuple{"dh0", &out.dh0, &ref.dh0}, std::tuple{"dA_log", &out.dA_log, &ref.dA_log},
          std::tuple{"ddt_bias", &out.ddt_bias, &ref.ddt_bias}}) {
      // dg, dA_log and ddt_bias are dgamma times d gamma / d x, a factor up to
      // |lower_bound| exp(A_log) / 4 ~ 2.8e4 here: fp32 rounding of dgamma (a reverse sum with
      // cancellation under such decays) is amplified by it. Those are held to finiteness and a
      // looser bound; everything else to the fp32 bound.
      const std::string n = name;
      const bool amplified = n == "dg" || n == "dA_log" || n == "ddt_bias";
      const Metric m = compare(*a, *b);
      EXPECT_TRUE(m.finite && m.rel <= (amplified ? 5e-2 : 1e-4)) << name << " " << gate_name(gate) << ": " << m.str();
    }
  }
}

}  // namespace
}  // namespace kda::test

namespace kda::test {
namespace {

// The staged backward (the baseline: state cotangents of every chunk materialized, then every
// chunk's gradients in parallel) runs the same chunk functions. The fused one works in 16-token
// blocks inside each chunk, the staged one in whole chunks: bitwise equal at chunk size 16, equal
// to fp32 rounding otherwise.
class StagedBackward : public ::testing::TestWithParam<std::tuple<Residuals, int>> {};

TEST_P(StagedBackward, EqualsFusedToRounding) {
  const auto [residuals, chunk] = GetParam();
  Case c = packed_case(DType::kF32);
  c.chunk = chunk;
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 13);
  const Grads fused = run_backward(c, in, ct, false, residuals);
  c.path = Path::kStaged;
  const Grads staged = run_backward(c, in, ct, false, residuals);
  if (chunk != 16) {
    for (const auto& [out, ref, name] :
         {std::tuple{&fused.dq, &staged.dq, "dq"}, std::tuple{&fused.dk, &staged.dk, "dk"},
          std::tuple{&fused.dv, &staged.dv, "dv"}, std::tuple{&fused.dg, &staged.dg, "dg"},
          std::tuple{&fused.dbeta, &staged.dbeta, "dbeta"}, std::tuple{&fused.dh0, &staged.dh0, "dh0"},
          std::tuple{&fused.dA_log, &staged.dA_log, "dA_log"},
          std::tuple{&fused.ddt_bias, &staged.ddt_bias, "ddt_bias"}}) {
      const Metric m = compare(*out, *ref);
      EXPECT_TRUE(m.finite && m.rel <= 1e-5) << name << ": " << m.str();
    }
    return;
  }
  expect_bitwise(fused.dq, staged.dq, "dq");
  expect_bitwise(fused.dk, staged.dk, "dk");
  expect_bitwise(fused.dv, staged.dv, "dv");
  expect_bitwise(fused.dg, staged.dg, "dg");
  expect_bitwise(fused.dbeta, staged.dbeta, "dbeta");
  expect_bitwise(fused.dh0, staged.dh0, "dh0");
  expect_bitwise(fused.dA_log, staged.dA_log, "dA_log");
  expect_bitwise(fused.ddt_bias, staged.ddt_bias, "ddt_bias");
}

INSTANTIATE_TEST_SUITE_P(BackwardExact, StagedBackward,
                         ::testing::Combine(::testing::Values(Residuals::kSaved, Residuals::kRemat,
                                                              Residuals::kSavedVNew),
                                            ::testing::Values(64, 32, 16)),
                         [](const auto& info) {
                           return std::string(residuals_name(std::get<0>(info.param))) + "_chunk" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(BackwardStaged, MatchesAdjointOracleWithPadding) {
  Case c;
  c.B = 2, c.T = 90, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.segment_ids.assign(60, 1);
  c.segment_ids.resize(70, 2);
  c.segment_ids.resize(180, 0);
  for (std::int64_t t = 90; t < 170; ++t) c.segment_ids[t] = 1;  // row 2: one segment, 10 padding
  c.max_num_segments = 2;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  c.path = Path::kStaged;
  expect_backward_matches_oracle(c, Residuals::kSaved);
  expect_backward_matches_oracle(c, Residuals::kRemat);
}

}  // namespace
}  // namespace kda::test

namespace kda::test {
namespace {

// Gate-parameter gradients are sums over every token of every segment: reduced in chunk order,
// they do not depend on the thread count or the schedule.
TEST(BackwardExact, ParameterGradientsIndependentOfThreads) {
  Case c;
  c.cu_seqlens = {0, 40, 170, 171, 300};
  c.T = 300, c.H = 2, c.HV = 4, c.K = 32, c.V = 32;
  c.gate = Gate::kLowerBound;
  c.initial_state = true;
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 14);
  c.threads = 1;
  const Grads one = run_backward(c, in, ct, false);
  for (int threads : {2, 3, 0}) {
    c.threads = threads;
    for (int rep = 0; rep < 3; ++rep) {
      const Grads many = run_backward(c, in, ct, false);
      expect_bitwise(one.dA_log, many.dA_log, "dA_log, threads=" + std::to_string(threads));
      expect_bitwise(one.ddt_bias, many.ddt_bias, "ddt_bias, threads=" + std::to_string(threads));
      expect_bitwise(one.dq, many.dq, "dq, threads=" + std::to_string(threads));
    }
  }
}

}  // namespace
}  // namespace kda::test

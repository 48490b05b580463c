// The v_new residual (ForwardParams::v_new, the token deltas beta_t (v_t - S~_t^T k_t)): the
// forward's rows match the fp64 oracle's and are exactly zero on padding tokens; handed to the
// backward, with saved or rematerialized states, on either path, in either state layout and at
// every chunk size, it changes no gradient bit (it is bitwise the Vn the backward would form).
#include "test_util.hpp"

namespace kda::test {
namespace {

// Two batch rows of segment ids: two segments then trailing padding; leading and inner padding.
Case padded_ids_case(DType dtype) {
  Case c;
  c.B = 2, c.T = 90, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.segment_ids.assign(60, 1);
  c.segment_ids.resize(70, 2);
  c.segment_ids.resize(90, 0);
  c.segment_ids.resize(95, 0);
  c.segment_ids.resize(150, 1);
  c.segment_ids.resize(152, 0);
  c.segment_ids.resize(180, 2);
  c.max_num_segments = 2;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  c.dtype = dtype;
  return c;
}

class VNewForward : public ::testing::TestWithParam<std::tuple<DType, Path>> {};

TEST_P(VNewForward, MatchesOracleDeltasAndZeroOnPadding) {
  const auto [dtype, path] = GetParam();
  for (Case c : {packed_case(dtype, 64, StateLayout::kKFirst), padded_ids_case(dtype)}) {
    c.path = path;
    const Inputs in = make_inputs(c);
    const Outputs ref = run_forward(c, in, true, true);
    const Outputs out = run_forward(c, in, false, true);
    const Metric m = compare(out.v_new, ref.v_new);
    const double bound = forward_bound(dtype);
    EXPECT_TRUE(m.finite && m.rel <= bound) << "v_new: " << m.str() << " bound=" << bound << "\n" << c.describe();
    if (c.segment_ids.empty()) continue;
    const std::int64_t row = c.HV * c.V;  // v_new elements per token
    for (std::int64_t t = 0; t < c.B * c.T; ++t) {
      if (c.segment_ids[t] != 0) continue;
      for (std::int64_t j = 0; j < row; ++j)
        ASSERT_EQ(out.v_new[t * row + j], 0.0) << "padding token " << t << " has a nonzero v_new";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(VNew, VNewForward,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(Path::kFused, Path::kStaged)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == Path::kFused ? "_fused" : "_staged");
                         });

void expect_same_grads(const Grads& a, const Grads& b, const std::string& what) {
  expect_bitwise(a.dq, b.dq, what + " dq");
  expect_bitwise(a.dk, b.dk, what + " dk");
  expect_bitwise(a.dv, b.dv, what + " dv");
  expect_bitwise(a.dg, b.dg, what + " dg");
  expect_bitwise(a.dbeta, b.dbeta, what + " dbeta");
  expect_bitwise(a.dh0, b.dh0, what + " dh0");
  expect_bitwise(a.dA_log, b.dA_log, what + " dA_log");
  expect_bitwise(a.ddt_bias, b.ddt_bias, what + " ddt_bias");
}

class VNewBackward : public ::testing::TestWithParam<std::tuple<DType, int, StateLayout>> {};

// The fused backward reads Vn where it would form it from the same state with the same kernel.
TEST_P(VNewBackward, SameGradientsBitwise) {
  const auto [dtype, chunk, layout] = GetParam();
  const Case c = packed_case(dtype, chunk, layout);
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 21);
  const Grads saved = run_backward(c, in, ct, false, Residuals::kSaved);
  expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kSavedVNew), "saved + v_new vs saved:");
  expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kRematVNew), "remat + v_new vs saved:");
}

INSTANTIATE_TEST_SUITE_P(VNew, VNewBackward,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16), ::testing::Values(64, 32, 16),
                                            ::testing::Values(StateLayout::kKFirst, StateLayout::kVFirst)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_chunk" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) == StateLayout::kKFirst ? "_kfirst" : "_vfirst");
                         });

// Padding tokens between and after segments: their v_new rows are never read as a token's.
TEST(VNewBackwardPadding, SameGradientsBitwise) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Case c = padded_ids_case(dtype);
    const Inputs in = make_inputs(c);
    const Cotangents ct = make_cotangents(c, 22);
    const Grads saved = run_backward(c, in, ct, false, Residuals::kSaved);
    expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kSavedVNew), "saved + v_new vs saved:");
    expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kRematVNew), "remat + v_new vs saved:");
  }
}

// The staged backward (whole-chunk products) with the staged forward's v_new and states.
TEST(VNewStagedBackward, SameGradientsBitwise) {
  for (int chunk : {64, 32}) {
    Case c = packed_case(DType::kF32, chunk, StateLayout::kKFirst);
    c.path = Path::kStaged;
    const Inputs in = make_inputs(c);
    const Cotangents ct = make_cotangents(c, 23);
    const Grads saved = run_backward(c, in, ct, false, Residuals::kSaved, false, Path::kStaged);
    expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kSavedVNew, false, Path::kStaged),
                      "staged saved + v_new vs saved:");
    expect_same_grads(saved, run_backward(c, in, ct, false, Residuals::kRematVNew, false, Path::kStaged),
                      "staged remat + v_new vs saved:");
  }
}

}  // namespace
}  // namespace kda::test

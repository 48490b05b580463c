// The forward against the fp64 oracle (SPEC.md section 4 bounds), both paths, over the
// matrix of the forward issue: T, (K, V), (H, HV), dtypes, gate modes, l2norm, beta sigmoid,
// state layouts, initial/final states, chunk sizes.
#include "forward_cases.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

struct Shape {
  std::int64_t T, K, V, H, HV;
};

std::string shape_name(const Shape& s) {
  return "T" + std::to_string(s.T) + "_K" + std::to_string(s.K) + "_V" + std::to_string(s.V) + "_H" +
         std::to_string(s.H) + "_HV" + std::to_string(s.HV);
}

// Every T with every (K, V) and every (H, HV) would be 96 shapes x options; the CI set
// crosses T with (K, V) and cycles the head configurations; KDA_LARGE_TESTS takes all.
std::vector<Shape> shapes() {
  const std::int64_t Ts[] = {1, 15, 63, 64, 65, 1000};
  const std::pair<std::int64_t, std::int64_t> KVs[] = {{64, 64}, {60, 100}, {128, 128}, {256, 64}};
  const std::pair<std::int64_t, std::int64_t> Hs[] = {{1, 1}, {3, 3}, {2, 4}, {2, 8}};
  std::vector<Shape> out;
  int i = 0;
  for (auto T : Ts)
    for (auto kv : KVs) {
      if (large_tests()) {
        for (auto h : Hs) out.push_back({T, kv.first, kv.second, h.first, h.second});
      } else {
        auto h = Hs[i++ % 4];
        if (T == 1000 && h.second > 4) h = {1, 1};  // keep the oracle cheap in CI
        out.push_back({T, kv.first, kv.second, h.first, h.second});
      }
    }
  return out;
}

class ShapeMatrix : public ::testing::TestWithParam<std::tuple<Shape, Path>> {};

TEST_P(ShapeMatrix, Fp32MatchesOracle) {
  const auto [s, path] = GetParam();
  Case c;
  c.T = s.T, c.K = s.K, c.V = s.V, c.H = s.H, c.HV = s.HV, c.path = path;
  c.initial_state = true;
  c.seed = static_cast<std::uint32_t>(s.T * 131 + s.K * 7 + s.V + s.HV);
  expect_matches_oracle(c);
}

TEST_P(ShapeMatrix, Bf16MatchesOracle) {
  const auto [s, path] = GetParam();
  Case c;
  c.T = s.T, c.K = s.K, c.V = s.V, c.H = s.H, c.HV = s.HV, c.path = path;
  c.dtype = DType::kBF16;
  c.gate = Gate::kLowerBound;
  expect_matches_oracle(c);
}

// bf16 inputs run the state products as bf16 dot products (where the CPU has AVX512_BF16): their
// rounding must stay inside the bounds over a long sequence too, where it could accumulate in the
// state. The representative options (SPEC.md 5) at T = 8192, with and without bf16 products.
class LongBf16 : public ::testing::TestWithParam<bool> {};

TEST_P(LongBf16, MatchesOracleAtT8192) {
  expect_matches_oracle(long_bf16_case(8192, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Forward, LongBf16, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "bf16_products" : "fp32_products"); });

// The block that reads a caller's initial state keeps fp32 state products (forward_kernels.inc,
// reads_initial_state): with bf16 inputs, every sequence's first 16 outputs are bitwise those of
// a run with bf16_dot_products = false, packed sequences and pooled slots included. Later tokens
// take bf16 products where the CPU has them (not asserted: they are equal on other CPUs).
TEST(Bf16Products, FirstBlockWithInitialStateIsFp32) {
  Case c = packed_case(DType::kBF16);
  c.cu_seqlens = {0, 40, 41, 120};  // first blocks: tokens 0-15, 40, 41-56
  c.T = 120;
  c.K = 64, c.V = 48;
  const Inputs in = make_inputs(c);
  Case fp32_products = c;
  fp32_products.bf16_dot_products = false;
  const Outputs bf16 = run_forward(c, in, false), fp32 = run_forward(fp32_products, in, false);
  const std::int64_t row = c.HV * c.V;
  for (const auto& [start, len] : {std::pair<std::int64_t, std::int64_t>{0, 16}, {40, 1}, {41, 16}}) {
    const std::vector<double> a(bf16.o.begin() + start * row, bf16.o.begin() + (start + len) * row);
    const std::vector<double> b(fp32.o.begin() + start * row, fp32.o.begin() + (start + len) * row);
    expect_bitwise(a, b, "o of the first block from token " + std::to_string(start));
  }
}

// FlashKDA's tests start from arange states in V-first layout: rows of nearly equal values, far
// larger than anything the tokens build, so every output column of the first token is the same
// cancelling sum over K. With bf16 state products there the first token drifted to 6-9e-3 of the
// fp64 recurrence; the SPEC.md 4 bound is 5e-3. FlashKDA's gate and shapes (K = V = 128); with
// bf16 products in that block, seeds 6, 11 and 13 of these 16 measured 5.3-5.5e-3.
TEST(Bf16Products, ArangeInitialStateMatchesOracle) {
  for (std::uint32_t seed = 1; seed <= 16; ++seed) {
    Case c;
    c.T = 64, c.H = 4, c.HV = 4, c.K = 128, c.V = 128;
    c.dtype = DType::kBF16;
    c.gate = Gate::kLowerBound;
    c.beta_sigmoid = true;
    c.layout = StateLayout::kVFirst;
    c.initial_state = true;
    c.seed = seed;
    Inputs in = make_inputs(c);
    for (std::int64_t i = 0; i < in.h0.numel(); ++i) in.h0.set(i, static_cast<double>(i));  // fp32 state
    const Outputs got = run_forward(c, in, false), want = run_forward(c, in, true);
    const Metric m = compare(got.o, want.o);
    EXPECT_LE(m.rel, forward_bound(c.dtype)) << "seed " << seed << " o: " << m.str();
  }
}

// Heads narrower than 16 in K or V keep fp32 state products (kMinBf16DotWidth): a state of a
// few elements averages none of the bf16 operand rounding away, and with bf16 products the final
// state missed SPEC.md's 5e-3 (K = V = 1: up to 2.4e-2). So for them the option changes nothing
// (bitwise), and o and the final state meet the bf16 bounds, over 20 seeds each.
TEST(Bf16Products, NarrowHeadsKeepFp32Products) {
  for (const auto& [K, V] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {2, 2}, {3, 40}, {40, 8}})
    for (std::uint32_t seed = 1; seed <= 20; ++seed) {
      Case c;
      c.T = 100, c.H = 2, c.HV = 2, c.K = K, c.V = V;
      c.dtype = DType::kBF16;
      c.final_state = true;
      c.seed = seed;
      const Inputs in = make_inputs(c);
      Case fp32_products = c;
      fp32_products.bf16_dot_products = false;
      const Outputs got = run_forward(c, in, false), fp32 = run_forward(fp32_products, in, false);
      const std::string what =
          "K = " + std::to_string(K) + ", V = " + std::to_string(V) + ", seed " + std::to_string(seed);
      expect_bitwise(got.o, fp32.o, what + ": o");
      expect_bitwise(got.ht, fp32.ht, what + ": final state");
      const Outputs want = run_forward(c, in, true);
      const Metric mh = compare(got.ht, want.ht);
      EXPECT_LE(mh.rel, forward_bound(c.dtype)) << what << " final state: " << mh.str();
    }
}

INSTANTIATE_TEST_SUITE_P(Forward, ShapeMatrix,
                         ::testing::Combine(::testing::ValuesIn(shapes()),
                                            ::testing::Values(Path::kFused, Path::kStaged)),
                         [](const auto& info) {
                           return shape_name(std::get<0>(info.param)) + "_" + path_name(std::get<1>(info.param));
                         });

// Options (forward_cases.hpp), each crossed with dtype and path.
class OptionMatrix : public ::testing::TestWithParam<std::tuple<OptionCase, DType, Path>> {};

TEST_P(OptionMatrix, MatchesOracle) {
  const auto [oc, dtype, path] = GetParam();
  Case c = option_case(oc, dtype);
  c.path = path;
  expect_matches_oracle(c);
}

INSTANTIATE_TEST_SUITE_P(Forward, OptionMatrix,
                         ::testing::Combine(::testing::ValuesIn(option_cases()),
                                            ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(Path::kFused, Path::kStaged)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param)) + "_" + path_name(std::get<2>(info.param));
                         });

}  // namespace
}  // namespace kda::test

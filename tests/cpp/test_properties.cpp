// Exact contracts of SPEC.md section 4, asserted bitwise: packed vs padded layouts, fused vs
// staged, batch invariance, causality, layout equivalence (head-first strides, V-first
// states), padding outputs, empty segments, segment isolation; and extreme gates.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/fp_mode.hpp"
#include "test_util.hpp"

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace kda::test {
namespace {

Case packed_case(Path path, DType dtype) {
  Case c;
  c.cu_seqlens = {0, 15, 100, 300, 301, 301, 520};
  c.T = 520;
  c.H = 2, c.HV = 4, c.K = 40, c.V = 24;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  c.dtype = dtype;
  c.path = path;
  return c;
}

// o rows [start, start + len) of token-major o [B, T, HV, V], batch row b.
std::vector<double> rows(const Case& c, const std::vector<double>& o, std::int64_t b, std::int64_t start,
                         std::int64_t len) {
  const std::int64_t row = c.HV * c.V;
  return {o.begin() + (b * c.T + start) * row, o.begin() + (b * c.T + start + len) * row};
}

std::vector<double> state_slot(const Case& c, const std::vector<double>& ht, std::int64_t n) {
  const std::int64_t slot = c.HV * c.K * c.V;
  return {ht.begin() + n * slot, ht.begin() + (n + 1) * slot};
}

class PackedVsPadded : public ::testing::TestWithParam<std::tuple<Path, DType>> {};

TEST_P(PackedVsPadded, EachSegmentEqualsItsOwnFixedLengthRunBitwise) {
  const auto [path, dtype] = GetParam();
  const Case c = packed_case(path, dtype);
  const Inputs in = make_inputs(c);
  const Outputs packed = run_forward(c, in, false);
  for (std::size_t s = 0; s + 1 < c.cu_seqlens.size(); ++s) {
    const std::int64_t start = c.cu_seqlens[s], len = c.cu_seqlens[s + 1] - start;
    Case one = c;
    one.cu_seqlens.clear();
    one.T = len;
    const Outputs alone = run_forward(one, slice_sequence(c, in, 0, start, len, static_cast<std::int64_t>(s)), false);
    expect_bitwise(rows(c, packed.o, 0, start, len), alone.o, "o of segment " + std::to_string(s));
    expect_bitwise(state_slot(c, packed.ht, static_cast<std::int64_t>(s)), alone.ht,
                   "final state of segment " + std::to_string(s));
  }
}

INSTANTIATE_TEST_SUITE_P(Exact, PackedVsPadded,
                         ::testing::Combine(::testing::Values(Path::kFused, Path::kStaged),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

TEST(Exact, SegmentIdsEqualCuSeqlensBitwise) {
  Case c = packed_case(Path::kFused, DType::kF32);
  const Inputs in = make_inputs(c);
  const Outputs by_cu = run_forward(c, in, false);
  Case s = c;
  s.cu_seqlens.clear();
  // Empty cu_seqlens segments cannot be expressed as runs; drop them from the id map and
  // compare the non-empty ones.
  std::vector<std::int64_t> kept;
  for (std::size_t i = 0; i + 1 < c.cu_seqlens.size(); ++i) {
    const std::int64_t len = c.cu_seqlens[i + 1] - c.cu_seqlens[i];
    if (len == 0) continue;
    kept.push_back(static_cast<std::int64_t>(i));
    s.segment_ids.insert(s.segment_ids.end(), static_cast<std::size_t>(len), static_cast<std::int32_t>(kept.size()));
  }
  s.max_num_segments = static_cast<std::int64_t>(kept.size());
  Inputs in2 = in;
  HostTensor h0(DType::kF32, {s.max_num_segments, c.HV, c.K, c.V});
  const std::size_t slot = h0.bytes.size() / static_cast<std::size_t>(s.max_num_segments);
  for (std::size_t j = 0; j < kept.size(); ++j)
    std::memcpy(h0.bytes.data() + j * slot, in.h0.bytes.data() + static_cast<std::size_t>(kept[j]) * slot, slot);
  in2.h0 = h0;
  in2.ids = HostTensor(DType::kI32, {s.T});
  for (std::int64_t t = 0; t < s.T; ++t) in2.ids.set(t, s.segment_ids[t]);
  const Outputs by_ids = run_forward(s, in2, false);
  expect_bitwise(by_cu.o, by_ids.o, "o");
  for (std::size_t j = 0; j < kept.size(); ++j)
    expect_bitwise(state_slot(c, by_cu.ht, kept[j]), state_slot(s, by_ids.ht, static_cast<std::int64_t>(j)), "state");
}

// Padding (id 0) may lead a row and sit between segments (Tokamax's reference allows both): each
// segment still equals its own fixed-length run bitwise, padding rows get o = 0 exactly.
class SegmentIdsPadding : public ::testing::TestWithParam<Path> {};

TEST_P(SegmentIdsPadding, LeadingAndMiddlePaddingEachSegmentEqualsItsOwnRunBitwise) {
  Case c;
  c.T = 140, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  c.path = GetParam();
  struct Run {
    std::int32_t id;
    int len;
  };
  const Run layout[] = {{0, 9}, {1, 40}, {0, 5}, {2, 70}, {3, 10}, {0, 6}};
  for (const Run& r : layout) c.segment_ids.insert(c.segment_ids.end(), static_cast<std::size_t>(r.len), r.id);
  c.max_num_segments = 4;  // slot 4 stays empty
  const Inputs in = make_inputs(c);
  const Outputs all = run_forward(c, in, false);
  std::int64_t start = 0;
  for (const Run& r : layout) {
    if (r.id == 0) {
      EXPECT_EQ(rows(c, all.o, 0, start, r.len), std::vector<double>(static_cast<std::size_t>(r.len * c.HV * c.V), 0.0))
          << "padding rows at " << start;
    } else {
      Case one = c;
      one.segment_ids.clear();
      one.max_num_segments = 0;
      one.T = r.len;
      const Outputs alone = run_forward(one, slice_sequence(c, in, 0, start, r.len, r.id - 1), false);
      expect_bitwise(rows(c, all.o, 0, start, r.len), alone.o, "o of segment " + std::to_string(r.id));
      expect_bitwise(state_slot(c, all.ht, r.id - 1), alone.ht, "final state of segment " + std::to_string(r.id));
    }
    start += r.len;
  }
}

INSTANTIATE_TEST_SUITE_P(Exact, SegmentIdsPadding, ::testing::Values(Path::kFused, Path::kStaged),
                         [](const auto& info) { return std::string(path_name(info.param)); });

class FusedVsStaged : public ::testing::TestWithParam<std::tuple<DType, int>> {};

// The fused scan advances the state every 16 tokens, the staged path once per chunk: the same
// sums in another order, so they agree to rounding (fp32, or the output dtype's last bit), and
// bitwise at chunk size 16, where the order is the same.
TEST_P(FusedVsStaged, AgreeToRounding) {
  const auto [dtype, chunk] = GetParam();
  Case c = packed_case(Path::kFused, dtype);
  c.chunk = chunk;
  const Inputs in = make_inputs(c);
  const Outputs fused = run_forward(c, in, false);
  c.path = Path::kStaged;
  const Outputs staged = run_forward(c, in, false);
  if (chunk == 16) {
    expect_bitwise(fused.o, staged.o, "o");
    expect_bitwise(fused.ht, staged.ht, "final_state");
    return;
  }
  const Metric mo = compare(fused.o, staged.o), ms = compare(fused.ht, staged.ht);
  EXPECT_TRUE(mo.finite && mo.rel <= (dtype == DType::kF32 ? 1e-6 : 1e-3)) << "o: " << mo.str();
  EXPECT_TRUE(ms.finite && ms.rel <= 1e-6) << "final_state: " << ms.str();
  if (std::getenv("KDA_TEST_VERBOSE"))
    std::printf("fused vs staged: o %s, state %s\n", mo.str().c_str(), ms.str().c_str());
}

INSTANTIATE_TEST_SUITE_P(Exact, FusedVsStaged,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kF16),
                                            ::testing::Values(64, 32, 16)));

TEST(Exact, BatchInvarianceAcrossBatchAndThreads) {
  Case c;
  c.B = 3, c.T = 130, c.H = 2, c.HV = 2, c.K = 32, c.V = 32;
  c.initial_state = true;
  const Inputs in = make_inputs(c);
  const Outputs batch = run_forward(c, in, false);
  for (int threads : {1, 2, 3}) {
    Case one = c;
    one.B = 1;
    one.threads = threads;
    const Outputs alone = run_forward(one, slice_sequence(c, in, 1, 0, c.T, 1), false);
    expect_bitwise(rows(c, batch.o, 1, 0, c.T), alone.o, "o, threads=" + std::to_string(threads));
    expect_bitwise(state_slot(c, batch.ht, 1), alone.ht, "state, threads=" + std::to_string(threads));
  }
}

#if defined(__SSE__) || defined(__x86_64__)
// The kernels compute in one floating-point mode whatever the calling thread's (src/core/fp_mode.hpp:
// round to nearest, denormals flushed): a caller that flushes denormals (FTZ and DAZ set, as XLA's
// threads run) gets bitwise the results of one that does not, and so does a caller that rounds
// toward zero. v near 1e-36 keeps the outputs normal while the products under them pass through
// the denormal range. The mode is set around the library call only (the harness's conversions
// must not flush).
TEST(Exact, ResultsIgnoreTheCallersFloatingPointMode) {
  Case c;
  c.T = 70, c.H = 2, c.HV = 2, c.K = 32, c.V = 32;
  Inputs in = make_inputs(c);
  auto* v = reinterpret_cast<float*>(in.v.bytes.data());
  for (std::int64_t i = 0; i < in.v.numel(); ++i) v[i] *= 1e-36f;
  auto run = [&](unsigned set_bits) {
    HostTensor o(DType::kF32, {c.B, c.T, c.HV, c.V}), ht(DType::kF32, {c.B, c.HV, c.K, c.V});
    const ForwardParams p = make_params(c, in, o, ht);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | set_bits);
    const Status s = chunk_forward(p);
    _mm_setcsr(csr);
    EXPECT_TRUE(s.ok()) << s.message();
    return std::make_pair(o.bytes, ht.bytes);
  };
  const auto ieee = run(0);
  const auto* o = reinterpret_cast<const float*>(ieee.first.data());
  ASSERT_TRUE(std::any_of(o, o + ieee.first.size() / 4, [](float x) { return x != 0.0f; }));
  for (const auto& [bits, mode] :
       {std::pair<unsigned, const char*>{0x8040u, "flushes denormals"}, {0x6000u, "rounds toward zero"}}) {
    const auto other = run(bits);
    EXPECT_TRUE(ieee.first == other.first) << "o differs when the caller " << mode;
    EXPECT_TRUE(ieee.second == other.second) << "the final state differs when the caller " << mode;
  }
}

// Denormal inputs read as zero (FTZ / DAZ in the kernels, src/core/fp_mode.hpp): v scaled into the
// denormal range gives bitwise the outputs and final state of v = 0, fused and staged.
TEST(Exact, DenormalInputsReadAsZero) {
  if (!KDA_KERNELS_FLUSH_DENORMALS) GTEST_SKIP() << "this ISA keeps its default floating-point environment";
  for (const Path path : {Path::kFused, Path::kStaged}) {
    Case c;
    c.T = 70, c.H = 2, c.HV = 2, c.K = 32, c.V = 32;
    c.path = path;
    c.final_state = true;
    Inputs in = make_inputs(c);
    Inputs zero = in;
    auto* v = reinterpret_cast<float*>(in.v.bytes.data());
    for (std::int64_t i = 0; i < in.v.numel(); ++i) v[i] *= 1e-39f;
    ASSERT_NE(std::fpclassify(v[1]), FP_NORMAL);
    zero.v.fill(0.0);
    const Outputs got = run_forward(c, in, false), want = run_forward(c, zero, false);
    const std::string what = path == Path::kFused ? "fused" : "staged";
    expect_bitwise(got.o, want.o, what + ": o");
    expect_bitwise(got.ht, want.ht, what + ": final state");
  }
}
#endif

// Changing every input of token t leaves the outputs of tokens before t bitwise unchanged.
class Causality : public ::testing::TestWithParam<std::tuple<std::int64_t, Path>> {};

TEST_P(Causality, LaterTokensDoNotChangeEarlierOutputs) {
  const auto [t, path] = GetParam();
  Case c;
  c.T = 150, c.H = 1, c.HV = 2, c.K = 32, c.V = 16;
  c.gate = Gate::kSoftplus;
  c.path = path;
  const Inputs in = make_inputs(c);
  const Outputs base = run_forward(c, in, false);
  Inputs changed = in;
  for (HostTensor* x : {&changed.q, &changed.k, &changed.v, &changed.g, &changed.beta}) {
    const std::int64_t row = x->numel() / c.T;
    for (std::int64_t i = t * row; i < c.T * row; ++i) x->set(i, x->get(i) * -1.75 + 0.3);
  }
  const Outputs after = run_forward(c, changed, false);
  expect_bitwise(rows(c, base.o, 0, 0, t), rows(c, after.o, 0, 0, t), "o before t=" + std::to_string(t));
  const auto later = rows(c, after.o, 0, t, 1);
  const auto before = rows(c, base.o, 0, t, 1);
  EXPECT_NE(later, before) << "the change at t must reach o[t]; the test would be vacuous otherwise";
}

INSTANTIATE_TEST_SUITE_P(Exact, Causality,
                         ::testing::Combine(::testing::Values<std::int64_t>(1, 5, 16, 37, 63, 64, 65, 100, 149),
                                            ::testing::Values(Path::kFused, Path::kStaged)));

// Head-first [H, B, T, *] inputs are a stride choice: same result bitwise, no copy.
TEST(Exact, HeadFirstStridesEqualBatchFirst) {
  Case c;
  c.B = 2, c.T = 70, c.H = 2, c.HV = 4, c.K = 16, c.V = 24;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  const Inputs in = make_inputs(c);
  const Outputs ref = run_forward(c, in, false);
  // Re-lay every token tensor as [heads, B, T, D] and view it as [B, T, heads, D].
  auto head_first = [&](const HostTensor& x, std::int64_t heads, std::int64_t D) {
    HostTensor y(x.view.dtype, {heads, c.B, c.T, D});
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t d = 0; d < D; ++d)
            y.set(((h * c.B + b) * c.T + t) * D + d, x.get(((b * c.T + t) * heads + h) * D + d));
    y.view = y.view.permuted({1, 2, 0, 3});
    return y;
  };
  Inputs hf = in;
  hf.q = head_first(in.q, c.H, c.K);
  hf.k = head_first(in.k, c.H, c.K);
  hf.v = head_first(in.v, c.HV, c.V);
  hf.g = head_first(in.g, c.HV, c.K);
  hf.beta = head_first(in.beta, c.HV, 1);
  hf.beta.view.ndim = 3;  // [B, T, HV] with the trailing unit dim dropped
  HostTensor o(c.dtype, {c.HV, c.B, c.T, c.V}), ht(DType::kF32, {c.B, c.HV, c.K, c.V});
  ForwardParams p = make_params(c, hf, o, ht);
  p.o = o.view.permuted({1, 2, 0, 3});
  Status s = chunk_forward(p);
  ASSERT_TRUE(s.ok()) << s.message();
  std::vector<double> o_bf(ref.o.size());
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < c.T; ++t)
      for (std::int64_t h = 0; h < c.HV; ++h)
        for (std::int64_t d = 0; d < c.V; ++d)
          o_bf[((b * c.T + t) * c.HV + h) * c.V + d] = o.get(((h * c.B + b) * c.T + t) * c.V + d);
  expect_bitwise(ref.o, o_bf, "o");
  expect_bitwise(ref.ht, ht.to_double(), "final_state");
}

TEST(Exact, VFirstStateIsTheTransposeOfKFirst) {
  Case c;
  c.T = 77, c.H = 1, c.HV = 2, c.K = 20, c.V = 36;
  c.initial_state = true;
  Inputs in = make_inputs(c);
  const Outputs kf = run_forward(c, in, false);
  Case v = c;
  v.layout = StateLayout::kVFirst;
  Inputs vin = in;
  vin.h0 = HostTensor(DType::kF32, {1, c.HV, c.V, c.K});
  for (std::int64_t h = 0; h < c.HV; ++h)
    for (std::int64_t i = 0; i < c.K; ++i)
      for (std::int64_t j = 0; j < c.V; ++j) vin.h0.set((h * c.V + j) * c.K + i, in.h0.get((h * c.K + i) * c.V + j));
  const Outputs vf = run_forward(v, vin, false);
  expect_bitwise(kf.o, vf.o, "o");
  std::vector<double> back(kf.ht.size());
  for (std::int64_t h = 0; h < c.HV; ++h)
    for (std::int64_t i = 0; i < c.K; ++i)
      for (std::int64_t j = 0; j < c.V; ++j) back[(h * c.K + i) * c.V + j] = vf.ht[(h * c.V + j) * c.K + i];
  expect_bitwise(kf.ht, back, "final_state");
}

TEST(Exact, PaddingTokensGiveZeroAndEmptySlotsKeepInitialState) {
  Case c;
  c.T = 40, c.H = 1, c.HV = 2, c.K = 16, c.V = 16;
  c.segment_ids.assign(25, 1);
  c.segment_ids.resize(40, 0);
  c.max_num_segments = 3;
  c.initial_state = true;
  for (Path path : {Path::kFused, Path::kStaged}) {
    c.path = path;
    const Inputs in = make_inputs(c);
    const Outputs out = run_forward(c, in, false);
    for (double x : rows(c, out.o, 0, 25, 15)) ASSERT_EQ(x, 0.0) << path_name(path);
    const auto h0 = in.h0.to_double();
    expect_bitwise(state_slot(c, out.ht, 1), state_slot(c, h0, 1), "empty slot 2");
    expect_bitwise(state_slot(c, out.ht, 2), state_slot(c, h0, 2), "empty slot 3");
    c.initial_state = false;
    const Outputs zero = run_forward(c, in, false);
    for (double x : state_slot(c, zero.ht, 2)) ASSERT_EQ(x, 0.0) << "empty slot without h0";
    c.initial_state = true;
  }
}

// NaN and Inf in one segment's inputs never reach another segment (0 * Inf = NaN, so
// masking by multiplication would fail this).
TEST(Exact, SegmentIsolationUnderNaNAndInf) {
  Case c = packed_case(Path::kFused, DType::kF32);
  const Inputs in = make_inputs(c);
  for (Path path : {Path::kFused, Path::kStaged}) {
    c.path = path;
    const Outputs base = run_forward(c, in, false);
    Inputs bad = in;
    const std::int64_t s1 = c.cu_seqlens[1], s2 = c.cu_seqlens[2];  // poison segment 1
    const double inf = std::numeric_limits<double>::infinity();
    for (HostTensor* x : {&bad.q, &bad.k, &bad.v, &bad.g, &bad.beta}) {
      const std::int64_t row = x->numel() / c.T;
      for (std::int64_t i = s1 * row; i < s2 * row; i += 3) x->set(i, (i % 2) ? std::nan("") : -inf);
    }
    const Outputs after = run_forward(c, bad, false);
    expect_bitwise(rows(c, base.o, 0, 0, s1), rows(c, after.o, 0, 0, s1), "segment 0");
    expect_bitwise(rows(c, base.o, 0, s2, c.T - s2), rows(c, after.o, 0, s2, c.T - s2), "segments after 1");
    for (std::int64_t n : {0, 2, 3, 4, 5}) {
      expect_bitwise(state_slot(c, base.ht, n), state_slot(c, after.ht, n), "state " + std::to_string(n));
    }
  }
}

class ExtremeGates : public ::testing::TestWithParam<std::tuple<Path, DType, int>> {};

// g = -1000 on half the entries and 0 elsewhere: exact zeros after exp, no overflow anywhere.
TEST_P(ExtremeGates, FiniteAndWithinBounds) {
  const auto [path, dtype, chunk] = GetParam();
  Case c;
  c.T = 200, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
  c.extreme_gates = true;
  c.initial_state = true;
  c.path = path, c.dtype = dtype, c.chunk = chunk;
  expect_matches_oracle(c);
}

TEST(ExtremeGatesAll, ZeroDecayEverywhere) {
  Case c;
  c.T = 130, c.H = 1, c.HV = 1, c.K = 32, c.V = 32;
  c.initial_state = true;
  Inputs in = make_inputs(c);
  in.g.fill(0.0);
  const Outputs ref = run_forward(c, in, true);
  const Outputs out = run_forward(c, in, false);
  const Metric m = compare(out.o, ref.o);
  EXPECT_TRUE(m.finite && m.rel <= 1e-5) << m.str();
}

TEST(ExtremeGatesAll, LargeDecayEverywhereStaysFinite) {
  Case c;
  c.T = 130, c.H = 1, c.HV = 1, c.K = 32, c.V = 32;
  Inputs in = make_inputs(c);
  in.g.fill(-1000.0);
  const Outputs ref = run_forward(c, in, true);
  const Outputs out = run_forward(c, in, false);
  const Metric m = compare(out.o, ref.o);
  EXPECT_TRUE(m.finite && m.rel <= 1e-5) << m.str();
}

INSTANTIATE_TEST_SUITE_P(Numerics, ExtremeGates,
                         ::testing::Combine(::testing::Values(Path::kFused, Path::kStaged),
                                            ::testing::Values(DType::kF32, DType::kBF16), ::testing::Values(64, 16)));

}  // namespace
}  // namespace kda::test

namespace kda::test {
namespace {

// A few g = -1000 entries among ordinary ones: prefix sums near -1000 must not cost the
// later tokens their fp32 precision (this failed the 1e-5 bound with fp32 prefix sums).
class SparseVeryNegativeDecay : public ::testing::TestWithParam<Path> {};

TEST_P(SparseVeryNegativeDecay, Fp32WithinBound) {
  Case c;
  c.T = 300, c.H = 1, c.HV = 2, c.K = 64, c.V = 64;
  c.initial_state = true;
  c.path = GetParam();
  Inputs in = make_inputs(c);
  std::mt19937 rng(5);
  for (std::int64_t i = 0; i < in.g.numel(); ++i)
    if (rng() % 200 == 0) in.g.set(i, -1000.0);
  const Outputs ref = run_forward(c, in, true);
  const Outputs out = run_forward(c, in, false);
  const Metric mo = compare(out.o, ref.o), mh = compare(out.ht, ref.ht);
  EXPECT_TRUE(mo.finite && mo.rel <= 1e-5) << "o: " << mo.str();
  EXPECT_TRUE(mh.finite && mh.rel <= 1e-5) << "final_state: " << mh.str();
}

INSTANTIATE_TEST_SUITE_P(Numerics, SparseVeryNegativeDecay, ::testing::Values(Path::kFused, Path::kStaged),
                         [](const auto& info) { return std::string(path_name(info.param)); });

// A decay of exactly zero written as g = -inf (a hard reset), or as a huge finite -1e20: both are
// e^g = 0, so they must match the oracle like g = -1000 does. Unclamped, -inf made the prefix-sum
// differences NaN and -1e20 swamped the later tokens' sums.
class InfiniteDecay : public ::testing::TestWithParam<std::tuple<Path, double>> {};

TEST_P(InfiniteDecay, MatchesOracle) {
  const auto [path, value] = GetParam();
  Case c;
  c.T = 150, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
  c.initial_state = true;
  c.path = path;
  Inputs in = make_inputs(c);
  std::mt19937 rng(9);
  for (std::int64_t i = 0; i < in.g.numel(); ++i)
    if (rng() % 50 == 0) in.g.set(i, value);
  const Outputs ref = run_forward(c, in, true);
  const Outputs out = run_forward(c, in, false);
  const Metric mo = compare(out.o, ref.o), mh = compare(out.ht, ref.ht);
  EXPECT_TRUE(mo.finite && mo.rel <= 1e-5) << "o: " << mo.str();
  EXPECT_TRUE(mh.finite && mh.rel <= 1e-5) << "final_state: " << mh.str();
}

INSTANTIATE_TEST_SUITE_P(Numerics, InfiniteDecay,
                         ::testing::Combine(::testing::Values(Path::kFused, Path::kStaged),
                                            ::testing::Values(-std::numeric_limits<double>::infinity(), -1e20)),
                         [](const auto& info) {
                           return std::string(path_name(std::get<0>(info.param))) +
                                  (std::isinf(std::get<1>(info.param)) ? "_minus_inf" : "_minus_1e20");
                         });

}  // namespace
}  // namespace kda::test

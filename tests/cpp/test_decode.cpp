// Decode against a state pool and the inference forward's pooled initial states (SPEC.md
// section 3): against the fp64 oracle, against prefill, and the pool's exact contracts
// (untouched slots, padding rows, errors that write nothing).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "core/fp_mode.hpp"
#include "cpu/cpu_plan.hpp"
#include "decode_cases.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

constexpr double kPoison = 0x1p100;  // exact in fp32; untouched pool slots must keep exactly this

void expect_decode_matches_oracle(const DecodeCase& dc) {
  expect_decode_exec_matches_oracle(
      dc, [](const DecodeParams& p) { return decode(p); }, "decode");
}

class DecodeOptions : public ::testing::TestWithParam<DecodeCase> {};

// decode_option_cases(): every gate, dtype, layout and head shape, one token per row (with a
// padding row) and draft tokens with per-token slots and accepted counts (a rejected token's
// state not kept); o and the pool against the oracle, untouched slots bitwise unchanged.
TEST_P(DecodeOptions, MatchesOracle) {
  expect_decode_matches_oracle(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeOptions, ::testing::ValuesIn(decode_option_cases()),
                         [](const auto& info) { return info.param.name; });

// bf16 and fp16 pools (decode_narrow_pool_cases): o against the oracle as with fp32 pools (the
// state is fp32 between tokens), every written pool element the oracle's state rounded to nearest (within
// the fp32 computation's error),
// unwritten slots bitwise unchanged.
class DecodeNarrowPools : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeNarrowPools, MatchOracleRoundedToThePoolDtype) {
  expect_decode_matches_oracle(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeNarrowPools, ::testing::ValuesIn(decode_narrow_pool_cases()),
                         [](const auto& info) { return info.param.name; });

// Decoding T tokens one call at a time equals one prefill of T tokens, and the prefill's final
// state decodes correctly in both layouts.
class PrefillThenDecode : public ::testing::TestWithParam<StateLayout> {};

TEST_P(PrefillThenDecode, TokenByTokenEqualsPrefillAndContinuesIt) {
  Case c;
  c.B = 2, c.T = 70, c.H = 1, c.HV = 2, c.K = 32, c.V = 24;
  c.gate = Gate::kLowerBound;
  c.layout = GetParam();
  c.initial_state = false;
  c.final_state = true;
  const Inputs in = make_inputs(c);
  const Outputs prefill = run_forward(c, in, false);
  // Token-by-token decode of the same 70 tokens from zero states in slots 3 and 1.
  const std::int64_t slot = c.HV * c.K * c.V;
  HostTensor pool = c.layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {4, c.HV, c.K, c.V})
                                                     : HostTensor(DType::kF32, {4, c.HV, c.V, c.K});
  pool.fill(0.0);
  std::vector<double> o_dec(prefill.o.size());
  for (std::int64_t t = 0; t < c.T; ++t) {
    Case one = c;
    one.T = 1;
    Inputs step = in;
    for (HostTensor* x : {&step.q, &step.k, &step.v, &step.g, &step.beta}) {
      const std::int64_t row = x->numel() / (c.B * c.T);
      HostTensor y(x->view.dtype, {c.B, 1, row});
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t i = 0; i < row; ++i) y.set(b * row + i, x->get((b * c.T + t) * row + i));
      y.view = x->view;
      y.view.data = y.bytes.data();
      y.view.shape[1] = 1;
      y.view.strides[0] = row;
      *x = y;
    }
    HostTensor o(c.dtype, {c.B, 1, c.HV, c.V}), ht, idx(DType::kI32, {c.B}), acc;
    idx.set(0, 3);
    idx.set(1, 1);
    ForwardParams f = make_params(one, step, o, ht);
    DecodeParams p;
    p.q = f.q, p.k = f.k, p.v = f.v, p.g = f.g, p.beta = f.beta, p.A_log = f.A_log, p.dt_bias = f.dt_bias;
    p.o = o.view, p.options = f.options, p.state_pool = pool.view, p.slot_indices = idx.view;
    const Status s = decode(p);
    ASSERT_TRUE(s.ok()) << s.message();
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < c.HV * c.V; ++i) o_dec[(b * c.T + t) * c.HV * c.V + i] = o.get(b * c.HV * c.V + i);
  }
  const Metric mo = compare(o_dec, prefill.o);
  EXPECT_TRUE(mo.rel <= 1e-5) << "decode vs prefill o: " << mo.str();
  const auto p = pool.to_double();
  std::vector<double> dec_states(p.begin() + 3 * slot, p.begin() + 4 * slot);
  dec_states.insert(dec_states.end(), p.begin() + slot, p.begin() + 2 * slot);
  const Metric ms = compare(dec_states, prefill.ht);
  EXPECT_TRUE(ms.rel <= 1e-5) << "decode vs prefill final states: " << ms.str();

  // The prefill's final states, as a pool in the same layout, continue correctly.
  DecodeCase dc;
  dc.c = c;
  dc.c.T = 1;
  dc.c.seed = 77;
  dc.slots = 2;
  dc.idx = {1, 0};
  DecodeData d = make_decode_data(dc);
  for (std::int64_t i = 0; i < 2 * slot; ++i) d.pool.set(i, prefill.ht[i]);
  std::vector<double> eo, ep;
  oracle_decode(dc, d, &eo, &ep);
  HostTensor o(c.dtype, {c.B, 1, c.HV, c.V}), idx, acc;
  const DecodeParams dp = make_decode_params(dc, d, o, idx, acc);
  ASSERT_TRUE(decode(dp).ok());
  EXPECT_LE(compare(o.to_double(), eo).rel, 1e-5);
  EXPECT_LE(compare(d.pool.to_double(), ep).rel, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Decode, PrefillThenDecode, ::testing::Values(StateLayout::kKFirst, StateLayout::kVFirst),
                         [](const auto& info) {
                           return std::string(info.param == StateLayout::kKFirst ? "kfirst" : "vfirst");
                         });

TEST(DecodeExact, UntouchedSlotsAndPaddingRowsStayBitwiseUnchanged) {
  DecodeCase dc;
  dc.c.B = 3, dc.c.T = 2, dc.c.H = 1, dc.c.HV = 2, dc.c.K = 16, dc.c.V = 16;
  dc.slots = 10;
  dc.idx = {4, -1, 6, 2, -1, -1};  // row 0 keeps only token 0's state; row 2 is padding
  DecodeData d = make_decode_data(dc);
  const std::int64_t slot = dc.c.HV * dc.c.K * dc.c.V;
  for (std::int64_t s : {0, 1, 3, 5, 7, 8, 9})  // every slot no row writes
    for (std::int64_t i = 0; i < slot; ++i) d.pool.set(s * slot + i, kPoison);
  const std::vector<double> before = d.pool.to_double();
  HostTensor o(DType::kF32, {3, 2, 2, 16}), idx, acc;
  o.fill(12345.0);
  const DecodeParams p = make_decode_params(dc, d, o, idx, acc);
  ASSERT_TRUE(decode(p).ok());
  const std::vector<double> after = d.pool.to_double();
  for (std::int64_t s : {0, 1, 3, 5, 7, 8, 9})
    for (std::int64_t i = 0; i < slot; ++i) ASSERT_EQ(after[s * slot + i], kPoison) << "slot " << s;
  for (std::int64_t i = 0; i < 2 * 2 * 16; ++i) ASSERT_EQ(o.get(2 * 2 * 2 * 16 + i), 0.0) << "padding row o";
  EXPECT_NE(after[6 * slot], before[6 * slot]) << "row 1 writes slot 6 after token 0";
}

// Whether a step that leaves the state unchanged stored a pool element back as it must: its own
// bits, except that a bf16 denormal (exponent 0, magnitude below 2^-126: an fp32 denormal too)
// reads as zero in the kernels' floating-point mode (src/core/fp_mode.hpp) and comes back as a zero
// of either sign (where the kernels flush denormals: x86-64 and AArch64). fp16 denormals are normal
// fp32 numbers and are kept.
bool stored_as_expected(DType pool_dtype, std::uint16_t before, std::uint16_t after) {
  const bool bf16_denormal =
      KDA_KERNELS_FLUSH_DENORMALS && pool_dtype == DType::kBF16 && (before & 0x7f80) == 0 && (before & 0x7f) != 0;
  return bf16_denormal ? (after & 0x7fff) == 0 : after == before;
}

// One token with k = 0 and log decay 0 (S <- 1 * S + 0 r) on a narrow pool of 2 sequences x 2
// value heads of K x V states in `slots` slots (rows 0 and 1 in the last slot and slot 0), whose
// 16-bit elements `fill(pool_dtype, bits, n)` sets first; every element must come back as
// stored_as_expected says.
template <typename Fill>
void expect_unchanged_state_keeps_pool_bits(std::int64_t K, std::int64_t V, std::int64_t slots, Fill fill) {
  for (const DType pool_dtype : {DType::kBF16, DType::kF16})
    for (const StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
      DecodeCase dc;
      dc.c.B = 2, dc.c.T = 1, dc.c.H = 1, dc.c.HV = 2, dc.c.K = K, dc.c.V = V;
      dc.c.gate = Gate::kLogDecay, dc.c.l2norm = false, dc.c.layout = layout;
      dc.pool_dtype = pool_dtype;
      dc.slots = slots;
      dc.idx = {slots - 1, 0};
      DecodeData d = make_decode_data(dc);
      d.in.k.fill(0.0);
      d.in.g.fill(0.0);
      auto* bits = static_cast<std::uint16_t*>(d.pool.view.data);
      const std::int64_t n = d.pool.numel();
      fill(pool_dtype, bits, n);
      const std::vector<std::uint16_t> before(bits, bits + n);
      HostTensor o(DType::kF32, {2, 1, 2, V}), idx, acc;
      const DecodeParams p = make_decode_params(dc, d, o, idx, acc);
      ASSERT_TRUE(decode(p).ok());
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t slot = i / (n / slots);
        const bool addressed = slot == 0 || slot == slots - 1;  // dc.idx; the others keep every bit
        ASSERT_TRUE(addressed ? stored_as_expected(pool_dtype, before[i], bits[i]) : bits[i] == before[i])
            << "stored 0x" << std::hex << bits[i] << std::dec << ", " << (pool_dtype == DType::kBF16 ? "bf16" : "fp16")
            << " pool, " << (layout == StateLayout::kKFirst ? "K-first" : "V-first") << ", element " << i
            << " (pattern 0x" << std::hex << before[i] << std::dec << ")";
      }
    }
}

// A step that leaves the state as it was stores a narrow pool back bit for bit (bf16 denormals
// excepted: they read as zero, stored_as_expected), fp16 denormals
// included: the stores round to nearest even like detail::f32_to_bf16 / f32_to_f16
// (vcvtneps2bf16, which the bf16 V-first kernel uses where the CPU has it, would flush the
// denormals to zero). Both layouts (K-first with V = 40: the state converted into fp32 scratch and
// back; V-first: the converting kernel), every bit pattern of the low byte in the low elements.
TEST(DecodeExact, NarrowPoolsKeepTheirBitsWhenTheStateIsUnchanged) {
  expect_unchanged_state_keeps_pool_bits(48, 40, 3, [](DType, std::uint16_t* bits, std::int64_t n) {
    for (std::int64_t i = 0; i < n; i += 3) bits[i] = static_cast<std::uint16_t>(((i & 1) << 15) | (i & 0xff));
  });
}

// The same with K = V = 128, where one token in place runs the converting kernels on whole rows of
// vectors (V-first: decode_v_first's compile-time width; K-first: k_first_token), over every finite
// 16-bit pattern of the dtype (exponent not all ones: an Inf or NaN would make S^T k NaN), each
// converted to fp32 on the way in and rounded back on the way out (-0 left out: S + 0 r is +0).
TEST(DecodeExact, NarrowPoolsKeepEveryFinitePatternWhenTheStateIsUnchanged) {
  expect_unchanged_state_keeps_pool_bits(128, 128, 2, [](DType pool_dtype, std::uint16_t* bits, std::int64_t n) {
    const std::uint16_t exponent = pool_dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
    for (std::int64_t i = 0; i < n; ++i) {                         // n = 65536: every pattern once
      const auto pattern = static_cast<std::uint16_t>(i * 40503);  // odd: a permutation of the patterns
      bits[i] = (pattern & exponent) == exponent || pattern == 0x8000 ? std::uint16_t{0} : pattern;
    }
  });
}

// Where a narrow pool runs the fp32 pool's own kernels (one token in place: the converting
// kernels; draft tokens written back after the last: the fp32 group kernels on the state
// converted into scratch), both layouts, rows of whole vectors: o is the fp32 pool's bit for bit,
// and every pool element is the fp32 pool's state rounded to nearest even. Row 1 is padding.
TEST(DecodeExact, NarrowPoolsGiveTheFp32PoolsStateRounded) {
  for (const DType pool_dtype : {DType::kBF16, DType::kF16})
    for (const StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst})
      for (const std::int64_t T : {1, 3, 6}) {
        DecodeCase dc;
        dc.c.B = 3, dc.c.T = T, dc.c.H = 2, dc.c.HV = 2, dc.c.K = 64, dc.c.V = 48;
        dc.c.gate = Gate::kSoftplus, dc.c.layout = layout;
        dc.pool_dtype = pool_dtype;
        dc.slots = 5;
        dc.idx = {4, -1, 1};
        DecodeData narrow = make_decode_data(dc);
        DecodeCase wide_case = dc;
        wide_case.pool_dtype = DType::kF32;
        DecodeData wide = make_decode_data(wide_case);
        for (std::int64_t i = 0; i < narrow.pool.numel(); ++i) wide.pool.set(i, narrow.pool.get(i));
        HostTensor o_narrow(DType::kF32, {3, T, 2, 48}), o_wide(DType::kF32, {3, T, 2, 48}), idx, acc;
        const std::string what = std::string(pool_dtype == DType::kBF16 ? "bf16" : "fp16") + " pool, " +
                                 (layout == StateLayout::kKFirst ? "K-first" : "V-first") +
                                 ", T = " + std::to_string(T);
        ASSERT_TRUE(decode(make_decode_params(dc, narrow, o_narrow, idx, acc)).ok()) << what;
        ASSERT_TRUE(decode(make_decode_params(wide_case, wide, o_wide, idx, acc)).ok()) << what;
        for (std::int64_t i = 0; i < o_wide.numel(); ++i)
          ASSERT_EQ(o_narrow.get(i), o_wide.get(i)) << what << ", o element " << i;
        HostTensor rounded(pool_dtype, {1});
        for (std::int64_t i = 0; i < wide.pool.numel(); ++i) {
          rounded.set(0, wide.pool.get(i));
          ASSERT_EQ(narrow.pool.get(i), rounded.get(0))
              << what << ", pool element " << i << " (fp32 pool " << wide.pool.get(i) << ")";
        }
      }
}

// [N, T'] slot indices with T' > T (vLLM's [N, num_spec + 1] capacity): the first T columns are
// used, so o and the pool are bit for bit those of the [N, T] call; the extra columns are
// range-checked (an out-of-range one is refused with the pool untouched), and T' < T is refused.
TEST(DecodeExact, WiderSlotIndicesUseTheirFirstTColumns) {
  for (const StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    DecodeCase dc;
    dc.c.B = 3, dc.c.T = 3, dc.c.H = 1, dc.c.HV = 2, dc.c.K = 32, dc.c.V = 16, dc.c.layout = layout;
    dc.slots = 12;
    dc.idx = {4, 5, 6, -1, -1, -1, 9, -1, 2};
    dc.accepted = {2, 1, 3};
    DecodeData exact = make_decode_data(dc), wide = make_decode_data(dc);
    HostTensor o_exact(DType::kF32, {3, 3, 2, 16}), o_wide(DType::kF32, {3, 3, 2, 16}), idx, acc, idx_wide, acc_w;
    ASSERT_TRUE(decode(make_decode_params(dc, exact, o_exact, idx, acc)).ok());
    DecodeParams p = make_decode_params(dc, wide, o_wide, idx_wide, acc_w);
    for (const std::int64_t extra : {11, 12}) {  // 11 is a valid slot and ignored; 12 is out of range
      HostTensor wider(DType::kI64, {3, 5});
      for (std::int64_t n = 0; n < 3; ++n)
        for (std::int64_t t = 0; t < 5; ++t) wider.set(n * 5 + t, t < 3 ? dc.idx[n * 3 + t] : (t == 3 ? -1 : extra));
      p.slot_indices = wider.view;
      const std::vector<double> before = wide.pool.to_double();
      const Status s = decode(p);
      if (extra == 12) {
        ASSERT_FALSE(s.ok());
        EXPECT_NE(s.message().find("< slots = 12"), std::string::npos) << s.message();
        ASSERT_EQ(wide.pool.to_double(), before) << "pool written by a refused call";
        continue;
      }
      ASSERT_TRUE(s.ok()) << s.message();
    }
    for (std::int64_t i = 0; i < o_exact.numel(); ++i) ASSERT_EQ(o_wide.get(i), o_exact.get(i)) << "o element " << i;
    for (std::int64_t i = 0; i < exact.pool.numel(); ++i)
      ASSERT_EQ(wide.pool.get(i), exact.pool.get(i)) << "pool element " << i;
    HostTensor narrower(DType::kI64, {3, 2});
    narrower.fill(0.0);
    p.slot_indices = narrower.view;
    const Status s = decode(p);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("'slot_indices'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("[3, 2]"), std::string::npos) << s.message();
  }
}

// No tokens (T = 0), with [N] or [N, 0] slot indices: a valid call that reads and writes nothing.
TEST(DecodeExact, NoTokensLeavesThePoolUntouched) {
  for (const bool per_token : {false, true}) {
    DecodeCase dc;
    dc.c.B = 2, dc.c.T = 0, dc.c.H = 1, dc.c.HV = 2, dc.c.K = 16, dc.c.V = 16;
    dc.slots = 4;
    dc.idx = per_token ? std::vector<std::int64_t>{} : std::vector<std::int64_t>{3, 1};
    DecodeData d = make_decode_data(dc);
    const std::vector<double> before = d.pool.to_double();
    HostTensor o(DType::kF32, {2, 0, 2, 16}), idx, acc;
    DecodeParams p = make_decode_params(dc, d, o, idx, acc);
    if (per_token) {
      idx = HostTensor(DType::kI64, {2, 0});
      p.slot_indices = idx.view;
    }
    const Status s = decode(p);
    ASSERT_TRUE(s.ok()) << (per_token ? "[N, 0]: " : "[N]: ") << s.message();
    EXPECT_EQ(d.pool.to_double(), before) << "the pool was written";
  }
}

// Where the CPU takes strips (AMD, or KDA_DECODE_STRIPS=on, which ctest's second decode run sets
// on other CPUs: DecodeStrips.FollowTheVendorRuleOrTheEnvironment), a call whose K-first states
// pass 32 MB (cpu kKFirstStripMinBytes) decodes each state in column strips, smaller calls in
// whole-row passes (elsewhere both do): both sum in row order, so one large call gives the
// bits of the same rows decoded a few at a time (batch invariance), and the oracle's values. Row 3
// is padding. Shapes (K, V, T): V = 128, whole strips of two vectors; V = 112, three strips of two
// vectors and one of one on 16 lanes; K = 127 with V = 120, an odd number of rows and a strip of
// one vector on 8 lanes; 17 tokens, more than the draft-token groups take (kMaxFusedTokens), each
// decoded in place by the one-token kernels.
struct LargeDecodeShape {
  std::int64_t K, V, T;
};
std::string shape_name(const LargeDecodeShape& s) {
  return "K" + std::to_string(s.K) + "_V" + std::to_string(s.V) + "_T" + std::to_string(s.T);
}
inline void PrintTo(const LargeDecodeShape& s, std::ostream* os) {
  *os << shape_name(s);
}
class DecodeLargeCalls : public ::testing::TestWithParam<LargeDecodeShape> {};

TEST_P(DecodeLargeCalls, GiveTheBitsOfSmallOnes) {
  DecodeCase dc;
  dc.c.B = 160, dc.c.T = GetParam().T, dc.c.H = 2, dc.c.HV = 4, dc.c.K = GetParam().K, dc.c.V = GetParam().V;
  dc.c.gate = Gate::kLowerBound;
  dc.slots = 160;
  for (std::int64_t n = 0; n < dc.c.B; ++n) dc.idx.push_back(n == 3 ? -1 : (n * 7) % dc.c.B);
  ASSERT_GE(dc.c.B * dc.c.HV * dc.c.K * dc.c.V * 4, std::int64_t{32} << 20) << "the large call must use strips";
  DecodeData d = make_decode_data(dc);
  std::vector<double> eo, ep;
  oracle_decode(dc, d, &eo, &ep);
  const HostTensor pool0 = d.pool;
  HostTensor o_large(DType::kF32, {dc.c.B, dc.c.T, dc.c.HV, dc.c.V}), idx, acc;
  const DecodeParams large = make_decode_params(dc, d, o_large, idx, acc);
  ASSERT_TRUE(decode(large).ok());
  const std::vector<double> pool_large = d.pool.to_double();

  d.pool = pool0;
  HostTensor o_small(DType::kF32, {dc.c.B, dc.c.T, dc.c.HV, dc.c.V});
  DecodeParams small = make_decode_params(dc, d, o_small, idx, acc);
  constexpr std::int64_t kRows = 8;  // 8 x 4 states of at most 64 KB: whole-row passes
  auto rows_of = [](TensorView t, std::int64_t r0) {
    t.data = static_cast<char*>(t.data) + r0 * t.strides[0] * static_cast<std::int64_t>(dtype_size(t.dtype));
    t.shape[0] = kRows;
    return t;
  };
  for (std::int64_t r0 = 0; r0 < dc.c.B; r0 += kRows) {
    DecodeParams part = small;
    for (TensorView* t : {&part.q, &part.k, &part.v, &part.g, &part.beta, &part.o, &part.slot_indices})
      *t = rows_of(*t, r0);
    const Status s = decode(part);
    ASSERT_TRUE(s.ok()) << "rows " << r0 << ": " << s.message();
  }
  expect_bitwise(o_large.to_double(), o_small.to_double(), "o, one call vs calls of 8 rows");
  expect_bitwise(pool_large, d.pool.to_double(), "pool, one call vs calls of 8 rows");
  const Metric mo = compare(o_large.to_double(), eo), mp = compare(pool_large, ep);
  EXPECT_TRUE(mo.finite && mo.rel <= forward_bound(dc.c.dtype)) << "o: " << mo.str();
  EXPECT_TRUE(mp.finite && mp.rel <= 1e-5) << "pool: " << mp.str();
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeLargeCalls,
                         ::testing::Values(LargeDecodeShape{128, 128, 1}, LargeDecodeShape{128, 112, 1},
                                           LargeDecodeShape{127, 120, 1}, LargeDecodeShape{128, 128, 17}),
                         [](const ::testing::TestParamInfo<LargeDecodeShape>& i) { return shape_name(i.param); });

// Large K-first decode calls take column strips on AMD CPUs and whole-row passes elsewhere unless
// KDA_DECODE_STRIPS says otherwise (src/cpu/dispatch.cpp, choose_decode_strips), so the run of
// DecodeLargeCalls under the other setting does test the other kernel.
TEST(DecodeStrips, FollowTheVendorRuleOrTheEnvironment) {
  const char* env = std::getenv("KDA_DECODE_STRIPS");
  const std::string forced = env ? env : "";
  bool want = false;
#if defined(__x86_64__) || defined(_M_X64)
  want = __builtin_cpu_is("amd");
#endif
  if (forced == "on") want = true;
  if (forced == "off") want = false;
  EXPECT_EQ(cpu::k_first_decode_strips(), want) << "KDA_DECODE_STRIPS='" << forced << "'";
}

// Decodes dc with its pool copied to `offset` bytes past a 64-byte line; o and the pool after.
void decode_at_offset(const DecodeCase& dc, DecodeData& d, std::size_t offset, std::vector<double>* o_out,
                      std::vector<double>* pool_out) {
  const std::size_t bytes = d.pool.bytes.size();
  std::vector<unsigned char> raw(bytes + 128);
  const std::size_t to_line = (64 - reinterpret_cast<std::uintptr_t>(raw.data()) % 64) % 64;
  unsigned char* data = raw.data() + to_line + offset;
  std::memcpy(data, d.pool.bytes.data(), bytes);
  HostTensor o(DType::kF32, {dc.c.B, dc.c.T, dc.c.HV, dc.c.V}), idx, acc;
  DecodeParams p = make_decode_params(dc, d, o, idx, acc);
  p.state_pool.data = data;
  const Status s = decode(p);
  ASSERT_TRUE(s.ok()) << s.message();
  *o_out = o.to_double();
  HostTensor pool = d.pool;
  std::memcpy(pool.bytes.data(), data, bytes);
  *pool_out = pool.to_double();
}

// Runs dc on a line-aligned pool and on one 16 bytes off: the same bits either way, and the
// oracle's values.
void expect_aligned_and_offset_pools_agree(const DecodeCase& dc) {
  DecodeData d = make_decode_data(dc);
  std::vector<double> eo, ep;
  oracle_decode(dc, d, &eo, &ep);
  std::vector<double> o_aligned, pool_aligned, o_offset, pool_offset;
  ASSERT_NO_FATAL_FAILURE(decode_at_offset(dc, d, 0, &o_aligned, &pool_aligned));
  ASSERT_NO_FATAL_FAILURE(decode_at_offset(dc, d, 16, &o_offset, &pool_offset));
  expect_bitwise(o_aligned, o_offset, "o, aligned vs 16 bytes off");
  expect_bitwise(pool_aligned, pool_offset, "pool, aligned vs 16 bytes off");
  const Metric mo = compare(o_aligned, eo), mp = compare(pool_aligned, ep);
  EXPECT_TRUE(mo.finite && mo.rel <= forward_bound(dc.c.dtype)) << "o: " << mo.str();
  EXPECT_TRUE(mp.finite && mp.rel <= 1e-5) << "pool: " << mp.str();
}

// Draft tokens' states written to their own slots go past the caches where the pool's lines are
// 64-byte aligned and through plain stores where they are not.
class DecodeSlotStores : public ::testing::TestWithParam<StateLayout> {};

TEST_P(DecodeSlotStores, AlignedAndMisalignedPoolsGiveTheSameBits) {
  DecodeCase dc;
  dc.c.B = 3, dc.c.T = 3, dc.c.H = 1, dc.c.HV = 2, dc.c.K = 32, dc.c.V = 48, dc.c.layout = GetParam();
  dc.slots = 10;
  dc.idx = {1, 2, 3, 4, -1, 5, 6, 7, 8};  // row 1 keeps no state after token 1
  dc.accepted = {1, 2, 3};
  expect_aligned_and_offset_pools_agree(dc);
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeSlotStores, ::testing::Values(StateLayout::kKFirst, StateLayout::kVFirst),
                         [](const auto& info) {
                           return std::string(info.param == StateLayout::kKFirst ? "kfirst" : "vfirst");
                         });

// One token in place on a V-first pool: aligned rows of K = 64 or 128 take the kernel compiled for
// that width, rows off their lines the one for any K; the same sums in the same order.
class DecodeVFirstWidths : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(DecodeVFirstWidths, CompiledWidthGivesTheBitsOfTheGeneralKernel) {
  DecodeCase dc;
  dc.c.B = 3, dc.c.T = 1, dc.c.H = 2, dc.c.HV = 2, dc.c.K = GetParam(), dc.c.V = 37;  // V odd: a single row last
  dc.c.layout = StateLayout::kVFirst;
  dc.slots = 5;
  dc.idx = {3, 0, 4};
  expect_aligned_and_offset_pools_agree(dc);
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeVFirstWidths, ::testing::Values(64, 128),
                         [](const auto& info) { return "K" + std::to_string(info.param); });

struct DecodeError {
  const char* name;
  std::vector<std::int64_t> idx;
  std::vector<std::int64_t> accepted;
  std::int64_t T;
  std::vector<std::string> message_has;
};

void PrintTo(const DecodeError& e, std::ostream* os) {
  *os << e.name;
}

class DecodeErrors : public ::testing::TestWithParam<DecodeError> {};

TEST_P(DecodeErrors, NamesTheArgumentAndWritesNothing) {
  const DecodeError& de = GetParam();
  DecodeCase dc;
  dc.c.B = 3, dc.c.T = de.T, dc.c.H = 1, dc.c.HV = 1, dc.c.K = 16, dc.c.V = 16;
  dc.slots = 6;
  dc.idx = de.idx;
  dc.accepted = de.accepted;
  DecodeData d = make_decode_data(dc);
  const std::vector<double> before = d.pool.to_double();
  HostTensor o(DType::kF32, {3, de.T, 1, 16}), idx, acc;
  o.fill(7.0);
  const DecodeParams p = make_decode_params(dc, d, o, idx, acc);
  const Status s = decode(p);
  ASSERT_FALSE(s.ok());
  for (const auto& sub : de.message_has)
    EXPECT_NE(s.message().find(sub), std::string::npos) << "message lacks '" << sub << "': " << s.message();
  EXPECT_EQ(d.pool.to_double(), before) << "the pool was written on error";
  for (double x : o.to_double()) ASSERT_EQ(x, 7.0) << "o was written on error";
}

INSTANTIATE_TEST_SUITE_P(
    Decode, DecodeErrors,
    ::testing::Values(
        DecodeError{"slot_out_of_range", {1, 6, 2}, {}, 1, {"'slot_indices'", "< slots = 6", "got 6", "row 1"}},
        DecodeError{"duplicate_writer", {1, 3, 1}, {}, 1, {"'slot_indices'", "slot 1", "rows 0 and 2"}},
        DecodeError{"duplicate_writer_per_token", {0, 1, 2, 1, 4, 5}, {}, 2, {"slot 1", "rows 0 and 1"}},
        DecodeError{"accepted_out_of_range",
                    {0, 1, 2, 3, 4, 5},
                    {1, 3, 1},
                    2,
                    {"'num_accepted_tokens'", "[1, T = 2]", "got 3"}},
        DecodeError{"accepted_zero", {0, 1, 2, 3, 4, 5}, {1, 0, 1}, 2, {"'num_accepted_tokens'", "got 0"}},
        DecodeError{"late_slot_out_of_range", {0, 1, 2, 3, 4, 9}, {}, 2, {"got 9", "row 2, token 1"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(DecodeErrorsShape, PoolShapeAndDtype) {
  DecodeCase dc;
  dc.c.B = 2, dc.c.T = 1, dc.c.H = 1, dc.c.HV = 2, dc.c.K = 16, dc.c.V = 8;
  dc.idx = {0, 1};
  DecodeData d = make_decode_data(dc);
  HostTensor o(DType::kF32, {2, 1, 2, 8}), idx, acc;
  DecodeParams p = make_decode_params(dc, d, o, idx, acc);
  p.options.state_layout = StateLayout::kVFirst;  // the pool is K-first
  Status s = decode(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'state_pool'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[slots, HV, V, K]"), std::string::npos) << s.message();
  p = make_decode_params(dc, d, o, idx, acc);
  p.state_pool.dtype = DType::kF64;
  s = decode(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("float32, bfloat16 or float16, got float64"), std::string::npos) << s.message();
}

// The inference forward reads initial states from a pool by slot index, in place: the same
// result bitwise as the gathered states; a negative index means a zero state.
TEST(InferencePool, PooledInitialStatesEqualGatheredOnes) {
  Case c;
  c.cu_seqlens = {0, 20, 20, 90, 200};
  c.T = 200, c.H = 1, c.HV = 2, c.K = 32, c.V = 32;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  for (StateLayout layout : {StateLayout::kKFirst, StateLayout::kVFirst}) {
    c.layout = layout;
    Inputs in = make_inputs(c);
    const std::int64_t slot = c.HV * c.K * c.V;
    const std::int64_t slots[] = {5, 0, -1, 2};
    HostTensor pool = layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {6, c.HV, c.K, c.V})
                                                     : HostTensor(DType::kF32, {6, c.HV, c.V, c.K});
    pool.fill(kPoison);
    for (int n = 0; n < 4; ++n)
      if (slots[n] >= 0)
        for (std::int64_t i = 0; i < slot; ++i) pool.set(slots[n] * slot + i, in.h0.get(n * slot + i));
    for (std::int64_t i = 0; i < slot; ++i) in.h0.set(2 * slot + i, 0.0);  // slot -1: zero state
    const Outputs gathered = run_forward(c, in, false);
    HostTensor o(c.dtype, {1, c.T, c.HV, c.V});
    HostTensor ht = layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {4, c.HV, c.K, c.V})
                                                   : HostTensor(DType::kF32, {4, c.HV, c.V, c.K});
    HostTensor idx(DType::kI64, {4});
    for (int n = 0; n < 4; ++n) idx.set(n, static_cast<double>(slots[n]));
    ForwardParams p = make_params(c, in, o, ht);
    p.initial_state = pool.view;
    p.initial_state_indices = idx.view;
    const Status s = chunk_forward(p);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(o.to_double(), gathered.o);
    EXPECT_EQ(ht.to_double(), gathered.ht);
    idx.set(3, 6);
    const Status bad = chunk_forward(p);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.message().find("'initial_state_indices'"), std::string::npos) << bad.message();
  }
}

}  // namespace
}  // namespace kda::test

// The vector helpers of src/cpu/simd.hpp (compiled here for the test's own target, as each
// kernel translation unit compiles them for its own): reductions that kernels rely on to be
// bitwise equal to each other, and src/cpu/rows.hpp's bf16 / fp16 row conversions, which must
// match the scalar ones of core/dtype.hpp bit for bit. Compiled twice: into kda_tests for the
// baseline target (16 lanes, suite Simd), and on x86-64 into kda_simd_avx2_tests with
// KDA_VECTOR_BYTES = 32 and the avx2 target's flags (8 lanes, suite SimdAvx2), whose tests skip,
// saying so, on a CPU without AVX2. That one is its own executable: the std:: functions this file
// instantiates are compiled with AVX2 there, and the linker may keep that copy for every caller in
// the binary.
#include <gtest/gtest.h>
#if defined(__x86_64__)
#include <immintrin.h>  // simd.hpp's intrinsics on the x86 targets
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "core/dtype.hpp"  // the scalar conversions cpu/rows.hpp is checked against

#ifndef KDA_SIMD_SUITE
#define KDA_SIMD_SUITE Simd
#endif

namespace {
#include "cpu/simd.hpp"
// (after simd.hpp, whose vectors it uses)
#include "cpu/rows.hpp"

// Whether this CPU runs the instructions the file was compiled for.
bool cpu_runs_this_target() {
#if KDA_VECTOR_BYTES == 32
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}
#define KDA_REQUIRE_TARGET() \
  if (!cpu_runs_this_target()) GTEST_SKIP() << "this CPU lacks AVX2 + FMA + F16C (the avx2 target)"

std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// vsum4 and vsum8 sum 4 and 8 vectors with the same pairwise additions as that many vsums, so the
// V-first decode's results do not depend on which one a row group uses.
template <int N>
void expect_bitwise_vsums(void (*batched)(const vf*, float*)) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (int trial = 0; trial < 200; ++trial) {
    vf v[N];
    for (int i = 0; i < N; ++i)
      for (int l = 0; l < kLanes; ++l) v[i][l] = std::ldexp(uni(rng), expo(rng));  // rounding-sensitive magnitudes
    if (trial == 0) {  // signed zeros and infinities keep their vsum result too
      v[0] = vsplat(-0.0f);
      v[1][3] = std::numeric_limits<float>::infinity();
    }
    float got[N];
    batched(v, got);
    for (int i = 0; i < N; ++i)
      ASSERT_EQ(bits(got[i]), bits(vsum(v[i])))
          << "vsum" << N << ", trial " << trial << ", vector " << i << ": " << got[i] << " vs " << vsum(v[i]);
  }
}

TEST(KDA_SIMD_SUITE, Vsum4IsBitwiseFourVsums) {
  KDA_REQUIRE_TARGET();
  expect_bitwise_vsums<4>(vsum4);
}

TEST(KDA_SIMD_SUITE, Vsum8IsBitwiseEightVsums) {
  KDA_REQUIRE_TARGET();
  expect_bitwise_vsums<8>(vsum8);
}

struct GemmShape {
  std::int64_t m, n, kd;
  Tri tri;
  bool scaled;
};

// Shapes of the kernels' products (16-token blocks, K = V = 128) and odd ones: narrow, wide,
// partial tiles, triangular operands and outputs, the state update's row scaling.
const GemmShape kGemmShapes[] = {
    {16, 16, 128, Tri::kFull, false}, {16, 128, 16, Tri::kAUpper, false}, {16, 16, 256, Tri::kCLower, false},
    {32, 128, 16, Tri::kFull, false}, {128, 128, 16, Tri::kFull, true},   {5, 48, 7, Tri::kALower, false},
    {13, 80, 33, Tri::kFull, true},   {64, 64, 64, Tri::kCLower, false},
};

// Operands with rounding-sensitive magnitudes; the first two rows of A are zero (their products
// are zeros, whose sign the kFromZero contract covers).
void fill_operands(std::mt19937& rng, std::vector<float>& a, std::vector<float>& b, std::vector<float>& s) {
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);
  for (auto& x : a) x = std::ldexp(uni(rng), expo(rng));
  for (auto& x : b) x = std::ldexp(uni(rng), expo(rng));
  for (auto& x : s) x = std::fabs(uni(rng));
}

// Whether gemm writes C(i, j) for this shape (kCLower leaves columns past the row tile alone).
bool written(const GemmShape& g, std::int64_t i, std::int64_t j) {
  return g.tri != Tri::kCLower || j <= i;
}

// c_src = kFromZero gives bitwise what zeroing C first gives (signed zeros included), and reads
// nothing of C: it starts full of NaN here.
TEST(KDA_SIMD_SUITE, GemmFromZeroIsBitwiseGemmIntoZeros) {
  KDA_REQUIRE_TARGET();
  std::mt19937 rng(11);
  for (const GemmShape& g : kGemmShapes) {
    std::vector<float> a(g.m * g.kd), b(g.kd * g.n), scale(g.m);
    fill_operands(rng, a, b, scale);
    std::fill(a.begin(), a.begin() + std::min<std::int64_t>(2 * g.kd, a.size()), 0.0f);
    const float* cs = g.scaled ? scale.data() : nullptr;
    for (float alpha : {1.0f, -1.0f}) {
      std::vector<float> zeroed(g.m * g.n, 0.0f), from_zero(g.m * g.n, std::numeric_limits<float>::quiet_NaN());
      gemm(g.m, g.n, g.kd, a.data(), g.kd, 1, b.data(), g.n, zeroed.data(), g.n, alpha, g.tri, cs);
      gemm(g.m, g.n, g.kd, a.data(), g.kd, 1, b.data(), g.n, from_zero.data(), g.n, alpha, g.tri, cs, kFromZero);
      for (std::int64_t i = 0; i < g.m; ++i)
        for (std::int64_t j = 0; j < g.n; ++j)
          if (written(g, i, j))
            ASSERT_EQ(bits(from_zero[i * g.n + j]), bits(zeroed[i * g.n + j]))
                << g.m << " x " << g.n << " x " << g.kd << ", alpha " << alpha << ", C(" << i << ", " << j
                << "): " << from_zero[i * g.n + j] << " vs " << zeroed[i * g.n + j];
    }
  }
}

// The register tile gemm picks changes only which elements are computed together: each row of a
// product equals, bitwise, that row computed alone (a one-row product, one-row tiles).
TEST(KDA_SIMD_SUITE, GemmRowsDoNotDependOnTheTile) {
  KDA_REQUIRE_TARGET();
  std::mt19937 rng(12);
  for (const GemmShape& g : kGemmShapes) {
    if (g.tri != Tri::kFull) continue;  // triangular shapes bound a row's terms by its tile
    std::vector<float> a(g.m * g.kd), b(g.kd * g.n), scale(g.m), c0(g.m * g.n);
    fill_operands(rng, a, b, scale);
    fill_operands(rng, c0, b, scale);  // a nonzero C to add to; b and scale drawn again
    std::vector<float> whole = c0;
    const float* cs = g.scaled ? scale.data() : nullptr;
    gemm(g.m, g.n, g.kd, a.data(), g.kd, 1, b.data(), g.n, whole.data(), g.n, 0.5f, Tri::kFull, cs);
    for (std::int64_t i = 0; i < g.m; ++i) {
      std::vector<float> row(c0.begin() + i * g.n, c0.begin() + (i + 1) * g.n);
      gemm(1, g.n, g.kd, a.data() + i * g.kd, g.kd, 1, b.data(), g.n, row.data(), g.n, 0.5f, Tri::kFull,
           cs ? cs + i : nullptr);
      for (std::int64_t j = 0; j < g.n; ++j)
        ASSERT_EQ(bits(whole[i * g.n + j]), bits(row[j])) << g.m << " x " << g.n << " x " << g.kd << ", C(" << i << ", "
                                                          << j << "): " << whole[i * g.n + j] << " vs " << row[j];
    }
  }
}

// The rows types convert as the scalar conversions do, bit for bit (the decode's narrow pools and
// the bf16 / fp16 inputs go through them). Loads: every 16-bit pattern.
template <typename Rows>
void expect_rows_load_every_pattern(float (*scalar)(std::uint16_t)) {
  for (std::uint32_t p0 = 0; p0 < 65536; p0 += kLanes) {
    std::uint16_t in[kLanes];
    for (int l = 0; l < kLanes; ++l) in[l] = static_cast<std::uint16_t>(p0 + l);
    float out[kLanes];
    vstore(out, Rows::load(in));
    for (int l = 0; l < kLanes; ++l) {
      ASSERT_EQ(bits(out[l]), bits(scalar(in[l]))) << "pattern 0x" << std::hex << in[l];  // NaN payloads too
    }
  }
}

// Stores: exact ties of both parities and their neighbours, NaNs whose payload is only in the low
// half (a plain rounding carries them into Inf, or into the sign for 0x7fffffff), infinities, the
// largest floats (rounding up to Inf), denormals, zeros, and random patterns, each lane checked.
std::vector<std::uint32_t> store_patterns() {
  std::vector<std::uint32_t> p = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7f800001, 0xff800001,
                                  0x7f808000, 0x7fbfffff, 0x7fc00000, 0x7fc00001, 0x7fffffff, 0xffffffff,
                                  0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7e8000, 0x00000001, 0x00008000,
                                  0x00018000, 0x0000ffff, 0x807fffff, 0x00800000, 0x477fe000, 0x477ff000,
                                  0x38000000, 0x33800000, 0x33000001, 0x3f808000, 0x3f818000, 0x3f807fff};
  std::mt19937 rng(11);
  for (int i = 0; i < 4096; ++i) {
    const std::uint32_t hi = rng() & 0xffff0000u;
    p.push_back(hi | 0x8000u);  // a tie
    p.push_back(hi | ((rng() & 1) ? 0x7fffu : 0x8001u));
    p.push_back(rng());
  }
  while (p.size() % kLanes) p.push_back(0);
  return p;
}

template <typename Rows>
void expect_rows_store_like(std::uint16_t (*scalar)(float)) {
  const std::vector<std::uint32_t> patterns = store_patterns();
  for (std::size_t i = 0; i < patterns.size(); i += kLanes) {
    float in[kLanes];
    std::memcpy(in, patterns.data() + i, sizeof in);
    std::uint16_t out[kLanes];
    Rows::store(out, vload(in));
    for (int l = 0; l < kLanes; ++l) {
      const std::uint16_t want = scalar(in[l]);
      ASSERT_EQ(out[l], want) << "fp32 0x" << std::hex << patterns[i + l] << ": 0x" << out[l] << ", the scalar 0x"
                              << want;
    }
  }
}

TEST(KDA_SIMD_SUITE, Bf16RowsLoadEveryPatternExactly) {
  KDA_REQUIRE_TARGET();
  expect_rows_load_every_pattern<BF16Rows>(kda::detail::bf16_to_f32);
}

TEST(KDA_SIMD_SUITE, Bf16RowsStoreRoundsLikeTheScalarConversion) {
  KDA_REQUIRE_TARGET();
  expect_rows_store_like<BF16Rows>(kda::detail::f32_to_bf16);
}

TEST(KDA_SIMD_SUITE, F16RowsLoadEveryPatternExactly) {
  KDA_REQUIRE_TARGET();
  expect_rows_load_every_pattern<F16Rows>(kda::detail::f16_to_f32);
}

TEST(KDA_SIMD_SUITE, F16RowsStoreRoundsLikeTheScalarConversion) {
  KDA_REQUIRE_TARGET();
  expect_rows_store_like<F16Rows>(kda::detail::f32_to_f16);
}

}  // namespace

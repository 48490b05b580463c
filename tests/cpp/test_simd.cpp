// The vector helpers of src/cpu/simd.hpp (compiled here for the test's own target, as each
// kernel translation unit compiles them for its own): reductions that kernels rely on to be
// bitwise equal to each other.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

namespace {
#include "cpu/simd.hpp"

std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// vsum8 sums 8 vectors with the same pairwise additions as 8 vsums, so the V-first decode's
// results do not depend on which of the two a row group uses.
TEST(Simd, Vsum8IsBitwiseEightVsums) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (int trial = 0; trial < 200; ++trial) {
    vf v[8];
    for (int i = 0; i < 8; ++i)
      for (int l = 0; l < kLanes; ++l) v[i][l] = std::ldexp(uni(rng), expo(rng));  // rounding-sensitive magnitudes
    if (trial == 0) {  // signed zeros and infinities keep their vsum result too
      v[0] = vsplat(-0.0f);
      v[1][3] = std::numeric_limits<float>::infinity();
    }
    float got[8];
    vsum8(v, got);
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(bits(got[i]), bits(vsum(v[i])))
          << "trial " << trial << ", vector " << i << ": " << got[i] << " vs " << vsum(v[i]);
  }
}

}  // namespace

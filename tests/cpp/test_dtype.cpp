// The integer binary16 conversions of src/core/dtype.hpp (f16_bits_to_f32, f32_to_f16_bits: the
// library's conversions on targets whose C++ compiler has no _Float16, AArch64 with GCC 12)
// against the compiler's own half type: _Float16 on x86-64, Arm's __fp16 (hardware conversions)
// on AArch64. Exact bits, NaN for NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "test_util.hpp"

namespace {

using kda::test::Half;

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

float widen_reference(std::uint16_t h) {
  Half x;
  std::memcpy(&x, &h, sizeof x);
  return static_cast<float>(x);
}

std::uint16_t narrow_reference(float f) {
  const Half x = static_cast<Half>(f);
  std::uint16_t h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}

TEST(Binary16, WideningIsExactForEveryValue) {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const float got = kda::detail::f16_bits_to_f32(static_cast<std::uint16_t>(h));
    const float want = widen_reference(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "binary16 0x" << std::hex << h;
      continue;
    }
    ASSERT_EQ(bits_of(got), bits_of(want)) << "binary16 0x" << std::hex << h << ": " << got << " vs " << want;
  }
}

// Every fp32 value next to a rounding boundary of binary16 (each midpoint between neighbours,
// and the fp32 values either side of it), every binary16 value itself, the overflow threshold,
// fp32 denormals, specials, and a million random bit patterns: rounded to nearest even alike.
TEST(Binary16, NarrowingRoundsToNearestEvenAsTheCompilerDoes) {
  std::vector<float> xs = {0.0f,     -0.0f,           INFINITY,        -INFINITY,       NAN,
                           65504.0f, 65519.99f,       65520.0f,        65536.0f,        1e-45f,
                           -1e-45f,  1.17549435e-38f, 5.96046448e-08f, 2.98023224e-08f, 2.98023242e-08f};
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {  // the finite positive binary16 values and their neighbours
    const float a = widen_reference(static_cast<std::uint16_t>(h));
    const float b = widen_reference(static_cast<std::uint16_t>(h + 1));
    const float mid = a + (b - a) / 2;  // exact in fp32
    for (const float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) xs.push_back(float_of(static_cast<std::uint32_t>(rng())));
  for (const float x : xs) {
    const std::uint16_t got = kda::detail::f32_to_f16_bits(x), want = narrow_reference(x);
    if (std::isnan(x)) {
      ASSERT_TRUE((got & 0x7c00u) == 0x7c00u && (got & 0x3ffu) != 0) << "NaN 0x" << std::hex << bits_of(x);
      continue;
    }
    ASSERT_EQ(got, want) << "fp32 0x" << std::hex << bits_of(x) << " (" << x << ")";
  }
}

}  // namespace

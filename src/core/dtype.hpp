// Scalar conversions between storage dtypes and fp32/fp64 compute types.
#pragma once

#include <cstdint>
#include <cstring>

#include "kda/tensor.hpp"

namespace kda::detail {

static inline float bf16_to_f32(std::uint16_t bits) {
  std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
static inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// IEEE binary16 <-> fp32 in integer steps: exact widening, narrowing rounded to nearest even
// (overflow to infinity, subnormals kept), a NaN stays a quiet NaN. The compiler's _Float16 does the
// same where the C++ compiler has it (x86-64 with GCC 12; tests/cpp/test_dtype.cpp checks the two
// agree on every binary16 value and on the fp32 rounding boundaries); GCC 12 for AArch64 has no
// _Float16 in C++, so other targets use these.
static inline float f16_bits_to_f32(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t exp = (bits >> 10) & 0x1fu, mant = bits & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u);  // infinity, or a quiet NaN
  } else if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalized into fp32's range
      exp = 113;
      while (!(mant & 0x400u)) mant <<= 1, --exp;
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

static inline std::uint16_t f32_to_f16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);                        // >= 65520: infinity
  if (a >= 0x38800000u)  // a normal binary16 (>= 2^-14): rebias, round the 13 dropped bits
    return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13));
  const std::uint32_t e = a >> 23;
  if (e < 102) return sign;                                              // below 2^-25: rounds to zero
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;  // value = m 2^(e - 150)
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

#if defined(__x86_64__) || defined(__i386__)
static inline float f16_to_f32(std::uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

static inline std::uint16_t f32_to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  std::uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}
#else
static inline float f16_to_f32(std::uint16_t bits) {
  return f16_bits_to_f32(bits);
}

static inline std::uint16_t f32_to_f16(float f) {
  return f32_to_f16_bits(f);
}
#endif

// Reads element `offset` (in elements) of a float tensor as T (float or double).
template <typename T>
static inline T load_as(const void* base, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<T>(static_cast<const float*>(base)[offset]);
    case DType::kBF16:
      return static_cast<T>(bf16_to_f32(static_cast<const std::uint16_t*>(base)[offset]));
    case DType::kF16:
      return static_cast<T>(f16_to_f32(static_cast<const std::uint16_t*>(base)[offset]));
    case DType::kF64:
      return static_cast<T>(static_cast<const double*>(base)[offset]);
    case DType::kI32:
      return static_cast<T>(static_cast<const std::int32_t*>(base)[offset]);
    case DType::kI64:
      return static_cast<T>(static_cast<const std::int64_t*>(base)[offset]);
  }
  return T(0);
}

template <typename T>
static inline void store_from(void* base, DType dtype, std::int64_t offset, T value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[offset] = static_cast<float>(value);
      return;
    case DType::kBF16:
      static_cast<std::uint16_t*>(base)[offset] = f32_to_bf16(static_cast<float>(value));
      return;
    case DType::kF16:
      static_cast<std::uint16_t*>(base)[offset] = f32_to_f16(static_cast<float>(value));
      return;
    case DType::kF64:
      static_cast<double*>(base)[offset] = static_cast<double>(value);
      return;
    case DType::kI32:
    case DType::kI64:
      return;  // never an output of a float op; validation rejects it
  }
}

static inline std::int64_t load_index(const TensorView& t, std::int64_t i) {
  return t.dtype == DType::kI64 ? static_cast<const std::int64_t*>(t.data)[i * t.strides[0]]
                                : static_cast<const std::int32_t*>(t.data)[i * t.strides[0]];
}

}  // namespace kda::detail

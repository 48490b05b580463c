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

// The benchmarks' tensors: owned through the library's accounting allocator (so measured peaks
// include them) and filled deterministically. Shared by kda-bench and kda-backward-alone.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "core/dtype.hpp"  // the library's binary16 rounding, on every target
#include "kda/kda.hpp"

namespace kda_bench {

// A tensor owned through the accounting allocator.
struct Tensor {
  kda::Buffer buf;
  kda::TensorView view;
  Tensor(kda::DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    buf.reset(kda::allocate(static_cast<std::size_t>(n) * kda::dtype_size(dtype)));
    if (!buf) {
      std::fprintf(stderr, "out of memory allocating a %s tensor\n", kda::dtype_name(dtype));
      std::exit(1);
    }
    view = kda::TensorView::contiguous(buf.get(), dtype, shape);
  }
};

// Fast deterministic fill: xorshift, uniform in [lo, hi), rounded to the tensor dtype.
inline void fill(Tensor& t, float lo, float hi, std::uint64_t seed) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const std::int64_t n = t.view.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = static_cast<float>((s >> 40) & 0xFFFFFF) / 16777216.0f;
    const float x = lo + (hi - lo) * u;
    switch (t.view.dtype) {
      case kda::DType::kF32:
        static_cast<float*>(t.buf.get())[i] = x;
        break;
      case kda::DType::kBF16: {
        std::uint32_t bits;
        std::memcpy(&bits, &x, 4);
        static_cast<std::uint16_t*>(t.buf.get())[i] = static_cast<std::uint16_t>(bits >> 16);
        break;
      }
      case kda::DType::kF16: {
        static_cast<std::uint16_t*>(t.buf.get())[i] = kda::detail::f32_to_f16(x);
        break;
      }
      default:
        break;
    }
  }
}

}  // namespace kda_bench

// Building blocks shared by the CUDA kernels (src/cuda/*.cu) and by their host emulation
// (tests/cpp/test_cuda_emulation.cpp): qualifiers, dtype conversions, exp/log, typed loads and
// stores, and the phase macros that let one block algorithm run either as a CUDA thread block
// or, on the CPU, as a loop over the block's threads.
//
// Phase discipline (what makes the emulation faithful): a block algorithm is a sequence of
// phases, each `KDA_PHASE(tid) { ... }` followed by `KDA_SYNC();`. Inside a phase a thread
// reads only shared memory written by earlier phases (or by itself in this phase) and writes
// only locations no other thread touches in this phase. Code between phases is uniform across
// the block (every thread computes the same values). On the GPU a phase is the body run once
// by each thread, then __syncthreads(); on the CPU it is a loop over tid = 0..kThreads-1. A
// phase that broke the discipline would race on the GPU and give thread-order-dependent
// results in the emulation; barriers cannot be forgotten because every phase ends in one.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define KDA_DI __device__ __forceinline__
#define KDA_HDI __host__ __device__ __forceinline__
#define KDA_BLOCK_FN __device__
#define KDA_PHASE(tid) for (int tid = static_cast<int>(threadIdx.x), kda_once_ = 1; kda_once_; kda_once_ = 0)
#define KDA_SYNC() __syncthreads()
#define KDA_UNROLL _Pragma("unroll")
#else
#include <cmath>
#include <cstring>

#include "core/dtype.hpp"  // the host's binary16 conversions
#define KDA_DI inline
#define KDA_HDI inline
#define KDA_BLOCK_FN
#define KDA_PHASE(tid) for (int tid = 0; tid < ::kda::cuda::kThreads; ++tid)
#define KDA_SYNC() ((void)0)
#define KDA_UNROLL
#endif

namespace kda::cuda {

using i64 = std::int64_t;

// Threads per block of every kernel (the phase loops of the emulation use the same number).
constexpr int kThreads = 256;

// Storage dtypes as the kernels see them. kAnyDtype: read the dtype at run time.
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kAnyDtype = 4 };

KDA_DI float u32_as_f32(std::uint32_t u) {
#if defined(__CUDACC__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

KDA_DI std::uint32_t f32_as_u32(float f) {
#if defined(__CUDACC__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KDA_DI float bf16_bits_to_f32(std::uint16_t b) {
  return u32_as_f32(static_cast<std::uint32_t>(b) << 16);
}

// Round to nearest even; NaN stays NaN (as src/core/dtype.hpp).
KDA_DI std::uint16_t f32_to_bf16_bits(float f) {
  std::uint32_t u = f32_as_u32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

KDA_DI float f16_bits_to_f32(std::uint16_t b) {
#if defined(__CUDACC__)
  return __half2float(__ushort_as_half(b));
#else
  return ::kda::detail::f16_to_f32(b);
#endif
}

KDA_DI std::uint16_t f32_to_f16_bits(float f) {
#if defined(__CUDACC__)
  return __half_as_ushort(__float2half_rn(f));
#else
  return ::kda::detail::f32_to_f16(f);
#endif
}

// Accurate (not fast-math) single-precision functions on both sides.
KDA_DI float kexp(float x) {
#if defined(__CUDACC__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

KDA_DI float klog1p(float x) {
#if defined(__CUDACC__)
  return log1pf(x);
#else
  return std::log1p(x);
#endif
}

KDA_DI float ksqrt(float x) {
#if defined(__CUDACC__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}

// Element `off` of a float tensor as fp32. DT fixes the dtype at compile time; kAnyDtype reads
// `dt` (uniform across the block, so the switch does not diverge).
template <int DT>
KDA_DI float load_f32(const void* p, int dt, i64 off) {
  if constexpr (DT == kF32) {
    return static_cast<const float*>(p)[off];
  } else if constexpr (DT == kBF16) {
    return bf16_bits_to_f32(static_cast<const std::uint16_t*>(p)[off]);
  } else if constexpr (DT == kF16) {
    return f16_bits_to_f32(static_cast<const std::uint16_t*>(p)[off]);
  } else if constexpr (DT == kF64) {
    return static_cast<float>(static_cast<const double*>(p)[off]);
  } else {
    switch (dt) {
      case kF32:
        return static_cast<const float*>(p)[off];
      case kBF16:
        return bf16_bits_to_f32(static_cast<const std::uint16_t*>(p)[off]);
      case kF16:
        return f16_bits_to_f32(static_cast<const std::uint16_t*>(p)[off]);
      default:
        return static_cast<float>(static_cast<const double*>(p)[off]);
    }
  }
}

template <int DT>
KDA_DI void store_f32(void* p, int dt, i64 off, float x) {
  if constexpr (DT == kF32) {
    static_cast<float*>(p)[off] = x;
  } else if constexpr (DT == kBF16) {
    static_cast<std::uint16_t*>(p)[off] = f32_to_bf16_bits(x);
  } else if constexpr (DT == kF16) {
    static_cast<std::uint16_t*>(p)[off] = f32_to_f16_bits(x);
  } else if constexpr (DT == kF64) {
    static_cast<double*>(p)[off] = static_cast<double>(x);
  } else {
    switch (dt) {
      case kF32:
        static_cast<float*>(p)[off] = x;
        return;
      case kBF16:
        static_cast<std::uint16_t*>(p)[off] = f32_to_bf16_bits(x);
        return;
      case kF16:
        static_cast<std::uint16_t*>(p)[off] = f32_to_f16_bits(x);
        return;
      default:
        static_cast<double*>(p)[off] = static_cast<double>(x);
        return;
    }
  }
}

// SPEC.md 1.3, in fp32 as the CPU kernels compute them (src/core/transforms.hpp).
KDA_DI float softplus_f32(float x) {
  return (x > 0.0f ? x : 0.0f) + klog1p(kexp(-(x < 0.0f ? -x : x)));
}
KDA_DI float sigmoid_f32(float x) {
  return 1.0f / (1.0f + kexp(-x));
}

KDA_HDI int imin(int a, int b) {
  return a < b ? a : b;
}
KDA_HDI i64 round_up64(i64 x, i64 m) {
  return (x + m - 1) / m * m;
}

}  // namespace kda::cuda

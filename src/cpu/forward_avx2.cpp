// The CPU kernels compiled for x86-64 with AVX2, FMA and F16C (x86-64-v3: Zen 2, Haswell and
// later without AVX-512) on 8-lane vectors; see forward_kernels.inc. Selected at run time by
// dispatch.cpp.
#define KDA_TARGET avx2
#define KDA_VECTOR_BYTES 32  // one AVX register per vector (simd.hpp)
#include <immintrin.h>

#include "cpu/forward_kernels.inc"

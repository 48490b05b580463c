// The CPU kernels compiled for x86-64 with AVX-512 (F, BW, DQ, VL) and FMA; see
// forward_kernels.inc. Selected at run time by dispatch.cpp.
#define KDA_TARGET avx512
#define KDA_BF16_DOT 1  // the bf16 product path, used where the CPU has AVX512_BF16
#include <immintrin.h>

#include "cpu/forward_kernels.inc"

// The CPU kernels compiled for x86-64 with AVX-512 (F, BW, DQ, VL) and FMA; see
// forward_kernels.inc. Selected at run time by dispatch.cpp.
#define KDA_TARGET avx512
#include "cpu/forward_kernels.inc"

// The CPU kernels compiled for the baseline instruction set of the build: correct everywhere,
// the fallback when the CPU lacks AVX-512 (or KDA_CPU_TARGET=generic); see forward_kernels.inc.
#define KDA_TARGET generic
#include "cpu/forward_kernels.inc"

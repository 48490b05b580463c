// libkda: Kimi Delta Attention kernels. Umbrella header.
#pragma once

#include "kda/memory.hpp"
#include "kda/ops.hpp"
#include "kda/options.hpp"
#include "kda/status.hpp"
#include "kda/tensor.hpp"

namespace kda {

// Library version, "MAJOR.MINOR.PATCH".
const char* version();
// The CPU kernel target chosen at run time: "avx512" (AVX-512 F/BW/DQ/VL), "avx2" (AVX2 + FMA +
// F16C) or "generic" (the build's baseline). The environment variable
// KDA_CPU_TARGET=generic|avx2|avx512 forces one (for tests); a value that names no target, or a
// target this CPU lacks, makes every kernel call fail with a message naming it.
const char* cpu_target();
// Whether bf16 inputs' state products run as bf16 pair dot products with fp32 accumulation
// (Options::bf16_dot_products permitting): on the avx512 target of a CPU with AVX512_BF16 that
// issues them as fast as its fp32 FMAs (AMD Zen 4 / Zen 5; Intel's Xeons run them at half that
// rate, so there bf16 inputs are multiplied in fp32). KDA_BF16_DOT_PRODUCTS=auto|on|off overrides
// the rule (on: wherever the CPU has AVX512_BF16; an unusable value fails every kernel call).
bool cpu_bf16_dot_products();

}  // namespace kda

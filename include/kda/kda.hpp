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
// The CPU kernel target chosen at run time: "avx512" (AVX-512 F/BW/DQ/VL, with bf16 dot products
// where the CPU has AVX512_BF16), "avx2" (AVX2 + FMA + F16C) or "generic" (the build's baseline).
// The environment variable KDA_CPU_TARGET=generic|avx2|avx512 forces one (for tests); a value that
// names no target, or a target this CPU lacks, makes every kernel call fail with a message naming it.
const char* cpu_target();

}  // namespace kda

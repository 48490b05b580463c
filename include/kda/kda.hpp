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
// The CPU kernel target chosen at run time: "avx512" or "generic".
// The environment variable KDA_CPU_TARGET=generic forces the portable one (for tests); a value other
// than generic or avx512 makes every kernel call fail with a message naming it.
const char* cpu_target();

}  // namespace kda

// Kernel launchers, one per explicit instantiation (src/cuda/forward_<name>.cu, decode.cu).
// Declared without CUDA headers: `stream` is a cudaStream_t, the result a cudaError_t.
#pragma once

#include <cstddef>

#include "cuda/kernel_args.hpp"

namespace kda::cuda {

using ForwardLauncher = int (*)(const FwdArgs& args, std::size_t smem_bytes, void* stream);

#define KDA_DECLARE_FORWARD_LAUNCHER(name) \
  int launch_forward_##name(const FwdArgs& args, std::size_t smem_bytes, void* stream);
KDA_DECLARE_FORWARD_LAUNCHER(k64_f32)
KDA_DECLARE_FORWARD_LAUNCHER(k64_bf16)
KDA_DECLARE_FORWARD_LAUNCHER(k64_f16)
KDA_DECLARE_FORWARD_LAUNCHER(k128_f32)
KDA_DECLARE_FORWARD_LAUNCHER(k128_bf16)
KDA_DECLARE_FORWARD_LAUNCHER(k128_f16)
KDA_DECLARE_FORWARD_LAUNCHER(generic)
#undef KDA_DECLARE_FORWARD_LAUNCHER

int launch_zero_padding(const PadArgs& args, void* stream);
int launch_decode(const DecArgs& args, std::size_t smem_bytes, void* stream);

}  // namespace kda::cuda

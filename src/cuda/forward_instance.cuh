// Defines the launcher of one fused-forward configuration of src/cuda/plan.hpp (kFwdKernels).
// Each src/cuda/forward_<name>.cu expands it once: one explicit instantiation per file keeps
// the kernels compiling in parallel and a change to one configuration from rebuilding all.
#pragma once

#include <cuda_runtime.h>

#include "cuda/forward_block.cuh"
#include "cuda/launch.hpp"
#include "cuda/plan.hpp"

#define KDA_FORWARD_INSTANCE(name, id)                                                                                \
  namespace kda::cuda {                                                                                               \
  template __global__ void fused_forward_kernel<                                                                      \
      kFwdKernels[static_cast<int>(id)].kmax, kFwdKernels[static_cast<int>(id)].vt,                                   \
      kFwdKernels[static_cast<int>(id)].cmax, kFwdKernels[static_cast<int>(id)].dtype>(const FwdArgs);                \
  int launch_forward_##name(const FwdArgs& args, std::size_t smem_bytes, void* stream) {                              \
    [[maybe_unused]] constexpr FwdKernelInfo k = kFwdKernels[static_cast<int>(id)];                                   \
    auto* kernel = &fused_forward_kernel<k.kmax, k.vt, k.cmax, k.dtype>;                                              \
    cudaError_t e =                                                                                                   \
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));      \
    if (e != cudaSuccess) return static_cast<int>(e);                                                                 \
    kernel<<<static_cast<unsigned>(args.num_items), kThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(args); \
    return static_cast<int>(cudaGetLastError());                                                                      \
  }                                                                                                                   \
  }

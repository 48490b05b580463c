// Decode against a state pool (src/cuda/decode_block.cuh) and the zeroing of padding rows of the
// forward output (src/cuda/forward_block.cuh). Dtypes are read at run time: decode moves the
// state, not the inputs.
#include <cuda_runtime.h>

#include "cuda/decode_block.cuh"
#include "cuda/forward_block.cuh"
#include "cuda/launch.hpp"

namespace kda::cuda {

__global__ void __launch_bounds__(kThreads) decode_kernel(const DecArgs a) {
  extern __shared__ __align__(16) unsigned char kda_smem[];
  decode_block(a, kda_smem, static_cast<i64>(blockIdx.x));
}

__global__ void __launch_bounds__(kThreads) zero_padding_kernel(const PadArgs a) {
  zero_padding_row(a, static_cast<i64>(blockIdx.x));
}

int launch_decode(const DecArgs& args, std::size_t smem_bytes, void* stream) {
  cudaError_t e =
      cudaFuncSetAttribute(&decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  decode_kernel<<<static_cast<unsigned>(args.num_items), kThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(
      args);
  return static_cast<int>(cudaGetLastError());
}

int launch_zero_padding(const PadArgs& args, void* stream) {
  zero_padding_kernel<<<static_cast<unsigned>(args.num_rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kda::cuda

// Fused forward, configuration k64_bf16 (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(k64_bf16, ::kda::cuda::FwdKernel::kK64BF16)

// Fused forward, configuration k128_bf16 (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(k128_bf16, ::kda::cuda::FwdKernel::kK128BF16)

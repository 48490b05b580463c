// Fused forward, configuration k128_f16 (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(k128_f16, ::kda::cuda::FwdKernel::kK128F16)

// Fused forward, configuration k64_f16 (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(k64_f16, ::kda::cuda::FwdKernel::kK64F16)

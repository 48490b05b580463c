// Fused forward, configuration generic (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(generic, ::kda::cuda::FwdKernel::kGeneric)

// Fused forward, configuration k64_f32 (src/cuda/plan.hpp, kFwdKernels).
#include "cuda/forward_instance.cuh"

KDA_FORWARD_INSTANCE(k64_f32, ::kda::cuda::FwdKernel::kK64F32)

// The CUDA backend's block algorithms (src/cuda/forward_block.cuh, decode_block.cuh) compiled by
// the host compiler and run on the CPU, phases as loops over the block's threads, with the same
// host planning as the GPU path (src/cuda/plan.hpp), against the fp64 oracle. Every kernel
// configuration that the GPU would instantiate runs here, so the kernels' indexing, chunking,
// reference points, state layouts, segment plan and options are tested on machines without a
// GPU. What this cannot see: CUDA-specific execution (launches, shared-memory limits, barriers
// across real threads, device memory); tests/cpp/test_cuda.cpp covers those on a GPU.
#include <cstring>

#include "core/problem.hpp"
#include "cuda/decode_block.cuh"
#include "cuda/forward_block.cuh"
#include "cuda/plan.hpp"
#include "cuda_cases.hpp"

namespace kda::test {
namespace {

using cuda::FwdKernel;

template <int I>
void emulate_config(const cuda::FwdArgs& a) {
  constexpr cuda::FwdKernelInfo k = cuda::kFwdKernels[I];
  cuda::emulate_fused_forward<k.kmax, k.vt, k.cmax, k.dtype>(a);
}

void emulate(FwdKernel kernel, const cuda::FwdArgs& a) {
  switch (kernel) {
    case FwdKernel::kK64F32:
      return emulate_config<0>(a);
    case FwdKernel::kK64BF16:
      return emulate_config<1>(a);
    case FwdKernel::kK64F16:
      return emulate_config<2>(a);
    case FwdKernel::kK128F32:
      return emulate_config<3>(a);
    case FwdKernel::kK128BF16:
      return emulate_config<4>(a);
    case FwdKernel::kK128F16:
      return emulate_config<5>(a);
    case FwdKernel::kGeneric:
      return emulate_config<6>(a);
    case FwdKernel::kCount:
      break;
  }
  FAIL() << "unknown kernel";
}

// The CUDA backend's chunk_forward with the kernel launch replaced by the emulation.
ForwardExec emulated_forward(bool force_generic) {
  return [force_generic](const ForwardParams& prm) -> Status {
    detail::Problem p;
    KDA_RETURN_IF_ERROR(detail::plan_forward(prm, /*oracle=*/false, &p));
    if (auto why = cuda::why_unsupported_sizes(p.K, p.V)) return Status::error(*why);
    const FwdKernel kernel = force_generic ? FwdKernel::kGeneric : cuda::select_forward_kernel(p, prm);
    cuda::FwdPlan plan;
    cuda::prepare_forward(prm, p, kernel, &plan);
    emulate(kernel, plan.args);
    cuda::emulate_zero_padding(plan.pad);
    return {};
  };
}

DecodeExec emulated_decode() {
  return [](const DecodeParams& prm) -> Status {
    detail::Problem p;
    KDA_RETURN_IF_ERROR(detail::plan_decode(prm, &p));
    if (auto why = cuda::why_unsupported_sizes(p.K, p.V)) return Status::error(*why);
    cuda::DecPlan plan;
    cuda::prepare_decode(prm, p, &plan);
    cuda::emulate_decode(plan.args);
    return {};
  };
}

class CudaEmulationForward : public ::testing::TestWithParam<NamedCase> {};

TEST_P(CudaEmulationForward, SelectedKernelMatchesOracle) {
  expect_exec_matches_oracle(GetParam().c, emulated_forward(false), "emulated kernel");
}

TEST_P(CudaEmulationForward, GenericKernelMatchesOracle) {
  expect_exec_matches_oracle(GetParam().c, emulated_forward(true), "emulated generic kernel");
}

INSTANTIATE_TEST_SUITE_P(CudaEmulation, CudaEmulationForward, ::testing::ValuesIn(cuda_forward_cases()),
                         [](const auto& info) { return info.param.name; });

class CudaEmulationDecode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(CudaEmulationDecode, MatchesOracle) {
  expect_decode_exec_matches_oracle(GetParam(), emulated_decode(), "emulated decode");
}

INSTANTIATE_TEST_SUITE_P(CudaEmulation, CudaEmulationDecode, ::testing::ValuesIn(decode_option_cases()),
                         [](const auto& info) { return info.param.name; });

// The kernel choice: fast paths need one dtype for q, k, v, g, o and K <= 64 / 128.
TEST(CudaEmulationPlan, KernelSelectionAndChunkSplit) {
  Case c;
  c.T = 10, c.K = 128, c.V = 200, c.dtype = DType::kBF16;
  const Inputs in = make_inputs(c);
  HostTensor o(c.dtype, {c.B, c.T, c.HV, c.V}), ht(DType::kF32, {1, c.HV, c.K, c.V});
  ForwardParams prm = make_params(c, in, o, ht);
  detail::Problem p;
  ASSERT_TRUE(detail::plan_forward(prm, false, &p).ok());
  EXPECT_EQ(cuda::select_forward_kernel(p, prm), FwdKernel::kK128BF16);
  cuda::FwdPlan plan;
  cuda::prepare_forward(prm, p, FwdKernel::kK128BF16, &plan);
  EXPECT_EQ(plan.args.ntiles, 7);  // 200 / 32
  EXPECT_EQ(plan.args.C, 64);
  EXPECT_EQ(plan.args.cs_every, 1);
  cuda::prepare_forward(prm, p, FwdKernel::kGeneric, &plan);
  EXPECT_EQ(plan.args.C, 32);  // the generic kernel splits a 64-token chunk in two
  EXPECT_EQ(plan.args.cs_every, 2);
  // Shared memory of every configuration at its largest K fits Hopper's 227 KiB per block.
  for (const cuda::FwdKernelInfo& k : cuda::kFwdKernels) {
    const std::int64_t bytes = cuda::fwd_layout(k.cmax, k.kmax, k.vt).total;
    EXPECT_LE(bytes, 227 * 1024) << k.name;
    std::printf("[ smem ] %-10s K<=%d VT=%d C<=%d: %lld bytes\n", k.name, k.kmax, k.vt, k.cmax,
                static_cast<long long>(bytes));
  }
  EXPECT_LE(cuda::dec_layout(256).total, 227 * 1024);
  // Mixed dtypes take the generic kernel.
  prm.g.dtype = DType::kF32;  // (selection looks at dtypes only)
  EXPECT_EQ(cuda::select_forward_kernel(p, prm), FwdKernel::kGeneric);
  EXPECT_TRUE(cuda::why_unsupported_sizes(257, 64).has_value());
  EXPECT_FALSE(cuda::why_unsupported_sizes(256, 256).has_value());
}

}  // namespace
}  // namespace kda::test

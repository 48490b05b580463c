// The CUDA backend on a GPU (built with KDA_HAVE_CUDA): the CPU suite's conformance cases with
// every tensor in device memory, through the public API, against the fp64 oracle with the
// SPEC.md section 4 bounds; decode against a state pool; the unsupported cases and the
// residency errors. Without a usable device every test skips and says why.
#include <cuda_runtime.h>

#include <cstdlib>

#include "cuda_cases.hpp"
#include "kda/cuda.hpp"

namespace kda::test {
namespace {

const std::string& no_device_reason() {
  static const std::string reason = [] {
    std::string why;
    return cuda_device_count(&why) > 0 ? std::string() : why;
  }();
  return reason;
}

#define KDA_SKIP_WITHOUT_DEVICE()                                        \
  do {                                                                   \
    if (!no_device_reason().empty()) GTEST_SKIP() << no_device_reason(); \
  } while (0)

// Device copies of host tensor views; outputs are copied back by finish().
class DeviceMirror {
 public:
  DeviceMirror() = default;
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() {
    for (const Block& b : blocks_) cuda_deallocate(b.dev);
  }

  // A device view with the host view's shape and strides (the contents copied over).
  TensorView put(const TensorView& host, bool output = false) {
    if (!host.defined() || host.numel() == 0) return host;
    std::int64_t span = 1;
    for (int i = 0; i < host.ndim; ++i) span += (host.shape[i] - 1) * host.strides[i];
    const std::size_t bytes = static_cast<std::size_t>(span) * dtype_size(host.dtype);
    void* dev = cuda_allocate(bytes);
    EXPECT_NE(dev, nullptr) << "cuda_allocate(" << bytes << ")";
    EXPECT_EQ(cudaMemcpy(dev, host.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    blocks_.push_back({host.data, dev, bytes, output});
    TensorView d = host;
    d.data = dev;
    return d;
  }

  // Waits for the device and copies the outputs back; a kernel error becomes the Status.
  Status finish() {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return Status::error(std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(e));
    for (const Block& b : blocks_)
      if (b.output) EXPECT_EQ(cudaMemcpy(b.host, b.dev, b.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return {};
  }

 private:
  struct Block {
    void* host;
    void* dev;
    std::size_t bytes;
    bool output;
  };
  std::vector<Block> blocks_;
};

// chunk_forward with every tensor on the device (index tensors too, unless indices_on_host).
ForwardExec gpu_forward(bool indices_on_host = false) {
  return [indices_on_host](const ForwardParams& hp) -> Status {
    DeviceMirror m;
    ForwardParams dp = hp;
    dp.q = m.put(hp.q), dp.k = m.put(hp.k), dp.v = m.put(hp.v), dp.g = m.put(hp.g), dp.beta = m.put(hp.beta);
    dp.A_log = m.put(hp.A_log), dp.dt_bias = m.put(hp.dt_bias), dp.initial_state = m.put(hp.initial_state);
    if (!indices_on_host) {
      dp.cu_seqlens = m.put(hp.cu_seqlens), dp.segment_ids = m.put(hp.segment_ids);
      dp.initial_state_indices = m.put(hp.initial_state_indices);
    }
    dp.o = m.put(hp.o, true), dp.final_state = m.put(hp.final_state, true),
    dp.chunk_states = m.put(hp.chunk_states, true);
    const Status s = chunk_forward(dp);
    const Status f = m.finish();
    return s.ok() ? f : s;
  };
}

DecodeExec gpu_decode() {
  return [](const DecodeParams& hp) -> Status {
    DeviceMirror m;
    DecodeParams dp = hp;
    dp.q = m.put(hp.q), dp.k = m.put(hp.k), dp.v = m.put(hp.v), dp.g = m.put(hp.g), dp.beta = m.put(hp.beta);
    dp.A_log = m.put(hp.A_log), dp.dt_bias = m.put(hp.dt_bias);
    dp.slot_indices = m.put(hp.slot_indices), dp.num_accepted_tokens = m.put(hp.num_accepted_tokens);
    dp.state_pool = m.put(hp.state_pool, true), dp.o = m.put(hp.o, true);
    const Status s = decode(dp);
    const Status f = m.finish();
    return s.ok() ? f : s;
  };
}

class CudaForward : public ::testing::TestWithParam<NamedCase> {
 protected:
  void SetUp() override { KDA_SKIP_WITHOUT_DEVICE(); }
};

TEST_P(CudaForward, MatchesOracle) {
  expect_exec_matches_oracle(GetParam().c, gpu_forward(), "CUDA forward");
}

TEST_P(CudaForward, GenericKernelMatchesOracle) {
  setenv("KDA_CUDA_KERNEL", "generic", 1);
  expect_exec_matches_oracle(GetParam().c, gpu_forward(), "CUDA forward (generic kernel)");
  unsetenv("KDA_CUDA_KERNEL");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaForward, ::testing::ValuesIn(cuda_forward_cases()),
                         [](const auto& info) { return info.param.name; });

class CudaDecode : public ::testing::TestWithParam<DecodeCase> {
 protected:
  void SetUp() override { KDA_SKIP_WITHOUT_DEVICE(); }
};

TEST_P(CudaDecode, MatchesOracle) {
  expect_decode_exec_matches_oracle(GetParam(), gpu_decode(), "CUDA decode");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaDecode, ::testing::ValuesIn(decode_option_cases()),
                         [](const auto& info) { return info.param.name; });

class CudaApi : public ::testing::Test {
 protected:
  void SetUp() override { KDA_SKIP_WITHOUT_DEVICE(); }
};

TEST_F(CudaApi, IndexTensorsMayStayOnTheHost) {
  Case c;
  c.cu_seqlens = {0, 100, 333, 700};
  c.T = 700, c.H = 2, c.HV = 4, c.K = 64, c.V = 64;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  expect_exec_matches_oracle(c, gpu_forward(/*indices_on_host=*/true), "CUDA forward, host cu_seqlens");
}

TEST_F(CudaApi, SegmentsAreBatchInvariantBitwise) {
  // SPEC.md section 4: a sequence's outputs do not depend on the packing around it (fp32).
  Case c;
  c.cu_seqlens = {0, 37, 300, 301, 650};
  c.T = 650, c.H = 1, c.HV = 2, c.K = 128, c.V = 128;
  const Inputs in = make_inputs(c);
  const ExecResult packed = run_forward_exec(c, in, gpu_forward(), false, false);
  const std::int64_t row = c.HV * c.V;
  for (std::size_t s = 0; s + 1 < c.cu_seqlens.size(); ++s) {
    const std::int64_t start = c.cu_seqlens[s], len = c.cu_seqlens[s + 1] - start;
    Case one = c;
    one.cu_seqlens.clear();
    one.T = len;
    const Inputs sub = slice_sequence(c, in, 0, start, len, static_cast<std::int64_t>(s));
    const ExecResult alone = run_forward_exec(one, sub, gpu_forward(), false, false);
    for (std::int64_t i = 0; i < len * row; ++i)
      ASSERT_EQ(alone.o[i], packed.o[start * row + i]) << "segment " << s << " element " << i;
  }
}

TEST_F(CudaApi, BackwardSaysItIsNotSupported) {
  Case c;
  const Inputs in = make_inputs(c);
  HostTensor o(c.dtype, {c.B, c.T, c.HV, c.V}), ht(DType::kF32, {1, c.HV, c.K, c.V}), d_o = o,
                                                                                      dq(c.dtype, {c.B, c.T, c.H, c.K});
  ForwardParams f = make_params(c, in, o, ht);
  DeviceMirror m;
  BackwardParams b;
  b.forward = f;
  b.forward.q = m.put(f.q), b.forward.k = m.put(f.k), b.forward.v = m.put(f.v), b.forward.g = m.put(f.g);
  b.forward.beta = m.put(f.beta);
  b.forward.final_state = TensorView{};
  b.d_o = m.put(d_o.view);
  b.dq = m.put(dq.view, true);
  for (const Status& s : {chunk_backward(b), validate_backward(b)}) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("not supported yet"), std::string::npos) << s.message();
  }
}

TEST_F(CudaApi, HeadDimAbove256SaysWhy) {
  Case c;
  c.K = 300, c.V = 16, c.T = 8;
  const Inputs in = make_inputs(c);
  HostTensor o(c.dtype, {c.B, c.T, c.HV, c.V}), ht(DType::kF32, {1, c.HV, c.K, c.V});
  const Status s = gpu_forward()(make_params(c, in, o, ht));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("at most 256"), std::string::npos) << s.message();
}

TEST_F(CudaApi, HostTensorAmongDeviceTensorsIsNamed) {
  Case c;
  const Inputs in = make_inputs(c);
  HostTensor o(c.dtype, {c.B, c.T, c.HV, c.V}), ht(DType::kF32, {1, c.HV, c.K, c.V});
  ForwardParams f = make_params(c, in, o, ht);
  DeviceMirror m;
  ForwardParams d = f;
  d.q = m.put(f.q), d.k = m.put(f.k), d.v = m.put(f.v), d.beta = m.put(f.beta), d.o = m.put(f.o, true);
  d.final_state = m.put(f.final_state, true);  // g stays on the host
  const Status s = chunk_forward(d);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("argument 'g' is host memory"), std::string::npos) << s.message();
}

TEST_F(CudaApi, AllocatorCountsPeakBytes) {
  cuda_reset_peak_memory();
  const MemoryStats before = cuda_memory_stats();
  void* a = cuda_allocate(1 << 20);
  void* b = cuda_allocate(3 << 20);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(cuda_memory_stats().current_bytes, before.current_bytes + (4 << 20));
  cuda_deallocate(b);
  cuda_deallocate(a);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const MemoryStats after = cuda_memory_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.peak_bytes, before.current_bytes + (4 << 20));
}

}  // namespace
}  // namespace kda::test

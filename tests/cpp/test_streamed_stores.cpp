// Tensors of 16 MB and more (o, the residual's chunk states and v_new, the gradients) are written
// with non-temporal stores when a row is whole cache lines on a 64-byte boundary, and with the
// ordinary row store otherwise (src/cpu/forward_kernels.inc, store_row_streamed). The same
// training step with every output on a 64-byte boundary and with every output 4 bytes off one
// must give the same bits. On a CPU without AVX-512 both runs take the ordinary store.
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace kda::test {
namespace {

// A contiguous tensor that starts `shift` bytes after a 64-byte boundary.
struct ShiftedTensor {
  std::vector<unsigned char> bytes;
  TensorView view;
  ShiftedTensor(DType dtype, std::initializer_list<std::int64_t> shape, std::size_t shift) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes.assign(static_cast<std::size_t>(n) * dtype_size(dtype) + 64 + shift, 0);
    const auto addr = reinterpret_cast<std::uintptr_t>(bytes.data());
    unsigned char* start = bytes.data() + (64 - addr % 64) % 64 + shift;
    view = TensorView::contiguous(start, dtype, shape);
  }
  std::vector<double> values() const {
    HostTensor copy(view.dtype, {view.numel()});
    std::memcpy(copy.bytes.data(), view.data, copy.bytes.size());
    return copy.to_double();
  }
};

// Every output of a training step, by name.
using Step = std::vector<std::pair<std::string, std::vector<double>>>;

// Forward with the saved states and v_new, then the backward, every output `shift` bytes off a
// 64-byte boundary.
Step training_step(const Case& c, const Inputs& in, const Cotangents& ct, std::size_t shift) {
  HostTensor unused_o(c.dtype, {1}), ht(DType::kF32, {c.B, c.HV, c.K, c.V});
  ForwardParams fwd = make_params(c, in, unused_o, ht);
  ShiftedTensor o(c.dtype, {c.B, c.T, c.HV, c.V}, shift);
  fwd.o = o.view;
  std::int64_t nc = 0;
  Status s = forward_chunk_count(fwd, &nc);
  EXPECT_TRUE(s.ok()) << s.message();
  ShiftedTensor states(DType::kF32, {nc, c.HV, c.K, c.V}, shift), v_new(DType::kF32, {c.B, c.T, c.HV, c.V}, shift);
  fwd.chunk_states = states.view;
  fwd.v_new = v_new.view;
  s = chunk_forward(fwd);
  EXPECT_TRUE(s.ok()) << s.message();
  ShiftedTensor dq(c.dtype, {c.B, c.T, c.H, c.K}, shift), dk(c.dtype, {c.B, c.T, c.H, c.K}, shift),
      dv(c.dtype, {c.B, c.T, c.HV, c.V}, shift), dg(c.dtype, {c.B, c.T, c.HV, c.K}, shift);
  BackwardParams bp;
  bp.forward = fwd;
  bp.d_o = ct.d_o.view;
  bp.d_final_state = ct.dht.view;
  bp.dq = dq.view, bp.dk = dk.view, bp.dv = dv.view, bp.dg = dg.view;
  s = chunk_backward(bp);
  EXPECT_TRUE(s.ok()) << s.message();
  return {{"o", o.values()},         {"chunk_states", states.values()},
          {"v_new", v_new.values()}, {"dq", dq.values()},
          {"dk", dk.values()},       {"dv", dv.values()},
          {"dg", dg.values()}};
}

class StreamedStores : public ::testing::TestWithParam<DType> {};

// bf16 and fp16 outputs and gradients (their lines go through store_row's conversion); the fp32
// chunk states and v_new in both.
TEST_P(StreamedStores, EqualOrdinaryStoresBitwise) {
  Case c = long_bf16_case(8192, true);  // o and each gradient 16 MB, chunk states 64 MB, v_new 32 MB
  c.H = c.HV = 8;
  c.dtype = GetParam();
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, 7);
  const Step aligned = training_step(c, in, ct, 0), shifted = training_step(c, in, ct, 4);
  for (std::size_t i = 0; i < aligned.size(); ++i)
    expect_bitwise(aligned[i].second, shifted[i].second, aligned[i].first);
}

INSTANTIATE_TEST_SUITE_P(Exact, StreamedStores, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace kda::test

// Host side of the CUDA backend that needs no CUDA runtime: which kernel configuration serves a
// problem, why a case is not supported, and the kernel arguments built from a validated
// detail::Problem (src/core/validate.cpp). Shared by src/cuda/cuda_backend.cpp (which uploads the
// tables and launches) and by the host emulation test (tests/cpp/test_cuda_emulation.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "cuda/device_math.cuh"
#include "cuda/kernel_args.hpp"

namespace kda::cuda {

// Largest K and V the CUDA backend serves (shared-memory budget of the generic kernel).
constexpr std::int64_t kMaxHeadDim = 256;

// The fused-forward kernel configurations, one explicit instantiation each
// (src/cuda/forward_<name>.cu). Fast paths need q, k, v, g and o in one dtype.
enum class FwdKernel : int { kK64F32, kK64BF16, kK64F16, kK128F32, kK128BF16, kK128F16, kGeneric, kCount };

struct FwdKernelInfo {
  const char* name;
  int kmax;   // K <= kmax
  int vt;     // V tile per block
  int cmax;   // largest chunk inside the kernel (option chunk sizes above it are split)
  int dtype;  // of q, k, v, g, o; kAnyDtype reads each at run time
};

inline constexpr FwdKernelInfo kFwdKernels[] = {
    {"k64_f32", 64, 64, 64, kF32},       {"k64_bf16", 64, 64, 64, kBF16},   {"k64_f16", 64, 64, 64, kF16},
    {"k128_f32", 128, 32, 64, kF32},     {"k128_bf16", 128, 32, 64, kBF16}, {"k128_f16", 128, 32, 64, kF16},
    {"generic", 256, 32, 32, kAnyDtype},
};
static_assert(sizeof(kFwdKernels) / sizeof(kFwdKernels[0]) == static_cast<int>(FwdKernel::kCount));

inline const FwdKernelInfo& kernel_info(FwdKernel k) {
  return kFwdKernels[static_cast<int>(k)];
}

inline int dtype_code(DType d) {
  switch (d) {
    case DType::kF32:
      return kF32;
    case DType::kBF16:
      return kBF16;
    case DType::kF16:
      return kF16;
    case DType::kF64:
      return kF64;
    default:
      return -1;  // index dtypes never reach a float load
  }
}

inline FwdKernel select_forward_kernel(const detail::Problem& p, const ForwardParams& prm) {
  const DType dt = prm.q.dtype;
  const bool uniform = prm.k.dtype == dt && prm.v.dtype == dt && prm.g.dtype == dt && prm.o.dtype == dt;
  const int base = dt == DType::kF32 ? 0 : dt == DType::kBF16 ? 1 : 2;
  if (uniform && p.K <= 64) return static_cast<FwdKernel>(static_cast<int>(FwdKernel::kK64F32) + base);
  if (uniform && p.K <= 128) return static_cast<FwdKernel>(static_cast<int>(FwdKernel::kK128F32) + base);
  return FwdKernel::kGeneric;
}

// Why the CUDA backend cannot run a problem that validation accepted; nullopt when it can.
inline std::optional<std::string> why_unsupported_sizes(std::int64_t K, std::int64_t V) {
  if (K > kMaxHeadDim || V > kMaxHeadDim) {
    return "kda (CUDA): head dims K = " + std::to_string(K) + ", V = " + std::to_string(V) +
           " are not supported on CUDA (at most " + std::to_string(kMaxHeadDim) +
           " each: the state tile and the chunk products must fit in shared memory); use host tensors for the CPU "
           "backend";
  }
  return std::nullopt;
}

inline DTensor to_dtensor(const TensorView& t) {
  DTensor d;
  if (!t.defined()) return d;
  d.data = t.data;
  d.dtype = dtype_code(t.dtype);
  for (int i = 0; i < t.ndim && i < 4; ++i) d.s[i] = t.strides[i];
  return d;
}

inline DState to_dstate(const TensorView& t, const detail::StateAddressing& a) {
  DState s;
  if (!t.defined()) return s;
  s.data = t.data;
  s.dtype = dtype_code(t.dtype);
  s.per_row = a.per_row;
  s.stride_row = a.stride_row;
  s.stride_slot = a.stride_slot;
  s.stride_hv = a.stride_hv;
  s.stride_k = a.stride_k;
  s.stride_v = a.stride_v;
  return s;
}

inline DTransforms to_transforms(const detail::Problem& p, const TensorView& A_log, const TensorView& dt_bias) {
  DTransforms tr;
  tr.gate = static_cast<int>(p.gate);
  tr.l2norm = p.l2norm ? 1 : 0;
  tr.beta_sigmoid = p.beta_sigmoid ? 1 : 0;
  tr.scale = p.scale;
  tr.lower_bound = p.lower_bound;
  tr.beta_scale = p.beta_scale;
  if (p.gate != detail::GateMode::kLogDecay) {
    // As detail::gate_params: A_log [HV]; dt_bias [HV * K] or [HV, K].
    if (A_log.defined()) tr.A_log = to_dtensor(A_log);
    if (dt_bias.defined()) {
      tr.dt_bias = to_dtensor(dt_bias);
      if (dt_bias.ndim == 1) {
        tr.dt_bias.s[0] = p.K * dt_bias.strides[0];
        tr.dt_bias.s[1] = dt_bias.strides[0];
      }
    }
  }
  return tr;
}

// Everything a forward launch needs; segs and pad_rows are host tables (the backend uploads them
// and points args.segs / pad.rows at the copies; the emulation uses them in place).
struct FwdPlan {
  FwdKernel kernel = FwdKernel::kGeneric;
  FwdArgs args;
  PadArgs pad;
  std::vector<DSeg> segs;
  std::vector<DRow> pad_rows;
};

// `prm` supplies the data pointers (device memory for the backend), `p` the validated plan.
inline void prepare_forward(const ForwardParams& prm, const detail::Problem& p, FwdKernel kernel, FwdPlan* plan) {
  const FwdKernelInfo& info = kernel_info(kernel);
  plan->kernel = kernel;
  FwdArgs& a = plan->args;
  a = FwdArgs{};
  a.q = to_dtensor(prm.q);
  a.k = to_dtensor(prm.k);
  a.v = to_dtensor(prm.v);
  a.g = to_dtensor(prm.g);
  a.beta = to_dtensor(prm.beta);
  a.o = to_dtensor(prm.o);
  a.tr = to_transforms(p, prm.A_log, prm.dt_bias);
  if (prm.initial_state.defined()) a.init = to_dstate(prm.initial_state, p.init_addr);
  if (prm.final_state.defined()) a.fin = to_dstate(prm.final_state, p.final_addr);
  if (prm.chunk_states.defined()) a.cs = to_dstate(prm.chunk_states, p.chunk_addr);
  a.K = static_cast<int>(p.K);
  a.V = static_cast<int>(p.V);
  a.HV = static_cast<int>(p.HV);
  a.group = static_cast<int>(p.group);
  a.C = std::min(p.chunk, info.cmax);
  a.cs_every = p.chunk / a.C;
  a.ntiles = static_cast<int>((p.V + info.vt - 1) / info.vt);

  // Segments, longest first (a stable order: equal lengths keep plan order).
  const std::size_t nseg = p.segments.size();
  std::vector<std::size_t> order(nseg);
  for (std::size_t s = 0; s < nseg; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return p.segments[x].length > p.segments[y].length; });
  plan->segs.resize(nseg);
  for (std::size_t r = 0; r < nseg; ++r) {
    const std::size_t s = order[r];
    const detail::Segment& sg = p.segments[s];
    DSeg& d = plan->segs[r];
    d.batch = sg.batch;
    d.start = sg.start;
    d.length = sg.length;
    d.state = sg.state;
    d.init_slot = prm.initial_state.defined() ? p.initial_slot(sg.state) : -1;
    d.chunk_offset = p.chunk_offset[s];
  }
  a.segs = plan->segs.data();
  a.num_items = static_cast<std::int64_t>(nseg) * a.HV * a.ntiles;

  plan->pad_rows.clear();
  for (const detail::PaddingRun& run : p.padding)
    for (std::int64_t t = run.start; t < run.end; ++t) plan->pad_rows.push_back({run.batch, t});
  PadArgs& pd = plan->pad;
  pd = PadArgs{};
  pd.o = a.o;
  pd.rows = plan->pad_rows.data();
  pd.num_rows = static_cast<std::int64_t>(plan->pad_rows.size());
  pd.HV = a.HV;
  pd.V = a.V;
}

struct DecPlan {
  DecArgs args;
  std::vector<std::int64_t> read, write;
};

constexpr int kDecodeVTile = 64;  // = kDecVT of decode_block.cuh

inline void prepare_decode(const DecodeParams& prm, const detail::Problem& p, DecPlan* plan) {
  DecArgs& a = plan->args;
  a = DecArgs{};
  a.q = to_dtensor(prm.q);
  a.k = to_dtensor(prm.k);
  a.v = to_dtensor(prm.v);
  a.g = to_dtensor(prm.g);
  a.beta = to_dtensor(prm.beta);
  a.o = to_dtensor(prm.o);
  a.tr = to_transforms(p, prm.A_log, prm.dt_bias);
  a.pool = to_dstate(prm.state_pool, p.init_addr);
  plan->read = p.decode_read;
  plan->write = p.decode_write;
  a.read = plan->read.data();
  a.write = plan->write.data();
  a.T = static_cast<int>(p.T);
  a.K = static_cast<int>(p.K);
  a.V = static_cast<int>(p.V);
  a.HV = static_cast<int>(p.HV);
  a.group = static_cast<int>(p.group);
  a.ntiles = static_cast<int>((p.V + kDecodeVTile - 1) / kDecodeVTile);
  a.num_items = p.B * a.HV * a.ntiles;
}

}  // namespace kda::cuda

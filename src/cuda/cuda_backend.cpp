// Host side of the CUDA backend (src/cuda/cuda_backend.hpp): index tensors staged to the host,
// validation with the CPU path's rules, the residency checks, the kernel choice, the device
// tables and the launches (docs/CUDA.md).
#include "cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "cuda/decode_block.cuh"   // dec_layout
#include "cuda/forward_block.cuh"  // fwd_layout
#include "cuda/launch.hpp"
#include "cuda/plan.hpp"
#include "kda/cuda.hpp"

namespace kda::cuda {
namespace {

bool runtime_usable() {
  static const bool usable = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return usable;
}

struct PointerInfo {
  bool device = false;
  int ordinal = -1;
};

PointerInfo pointer_info(const void* p) {
  PointerInfo info;
  if (p == nullptr || !runtime_usable()) return info;
  cudaPointerAttributes attr;
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return info;
  }
  info.device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  info.ordinal = attr.device;
  return info;
}

Status cuda_failure(const std::string& what, int code) {
  const auto e = static_cast<cudaError_t>(code);
  return Status::error("kda (CUDA): " + what + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// KDA_CUDA_KERNEL=generic forces the generic forward kernel (tests of the generic path on shapes
// that have a fast path).
bool force_generic() {
  const char* v = std::getenv("KDA_CUDA_KERNEL");
  return v != nullptr && std::strcmp(v, "generic") == 0;
}

// Replaces an index tensor in device memory by a host copy (validation reads it on the host).
Status stage_index(const char* name, TensorView* t, std::vector<std::vector<unsigned char>>* keep) {
  if (!t->defined() || t->ndim > kMaxDims || t->data == nullptr || !pointer_info(t->data).device) return {};
  std::int64_t span = 1;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] <= 0) return {};  // empty (or malformed, which validation reports): nothing to read
    if (t->strides[i] < 0) {
      return Status::error(std::string("kda (CUDA): argument '") + name +
                           "': negative strides are not supported for index tensors in device memory");
    }
    span += (t->shape[i] - 1) * t->strides[i];
  }
  const std::size_t bytes = static_cast<std::size_t>(span) * dtype_size(t->dtype);
  keep->emplace_back(bytes);
  const cudaError_t e = cudaMemcpy(keep->back().data(), t->data, bytes, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return cuda_failure(std::string("copying '") + name + "' to the host", e);
  t->data = keep->back().data();
  return {};
}

struct Arg {
  const char* name;
  const TensorView* t;
};

// Every data tensor of a CUDA call is device memory of one device.
template <std::size_t N>
Status require_device(const Arg (&args)[N], int* device) {
  int dev = -1;
  const char* first = nullptr;
  for (const Arg& a : args) {
    if (!a.t->defined() || a.t->data == nullptr || a.t->numel() == 0) continue;
    const PointerInfo pi = pointer_info(a.t->data);
    if (!pi.device) {
      return Status::error(std::string("kda (CUDA): argument '") + a.name +
                           "' is host memory while other tensors of the call are CUDA device memory; a CUDA call "
                           "needs every tensor in device memory (index tensors may be on either side)");
    }
    if (dev < 0) {
      dev = pi.ordinal;
      first = a.name;
    } else if (pi.ordinal != dev) {
      return Status::error(std::string("kda (CUDA): argument '") + a.name + "' is on CUDA device " +
                           std::to_string(pi.ordinal) + " but '" + first + "' is on device " + std::to_string(dev) +
                           "; all tensors of a call must be on one device");
    }
  }
  *device = dev;
  return {};
}

// Makes `device` current for the call and restores the previous device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0 || cudaGetDevice(&prev_) != cudaSuccess || prev_ == device) {
      prev_ = -1;
      return;
    }
    cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// A device table freed in stream order after the kernels that read it.
class DeviceTable {
 public:
  explicit DeviceTable(void* stream) : stream_(stream) {}
  ~DeviceTable() { cuda_deallocate(ptr_, stream_); }
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;

  template <typename T>
  Status upload(const std::vector<T>& host, const char* what) {
    const std::size_t bytes = host.size() * sizeof(T);
    ptr_ = cuda_allocate(bytes, stream_);
    if (ptr_ == nullptr) {
      return Status::error(std::string("kda (CUDA): out of device memory for the ") + what + " (" +
                           std::to_string(bytes) + " bytes)");
    }
    if (bytes == 0) return {};
    // From pageable memory: returns once the data is staged, so `host` may go away after it.
    const cudaError_t e =
        cudaMemcpyAsync(ptr_, host.data(), bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream_));
    if (e != cudaSuccess) return cuda_failure(std::string("uploading the ") + what, e);
    return {};
  }
  template <typename T>
  const T* get() const {
    return static_cast<const T*>(ptr_);
  }

 private:
  void* stream_;
  void* ptr_ = nullptr;
};

Status check_shared_memory(std::int64_t bytes, int device, const std::string& kernel) {
  int limit = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return cuda_failure("reading the shared-memory limit", e);
  if (bytes > limit) {
    return Status::error("kda (CUDA): the " + kernel + " kernel needs " + std::to_string(bytes) +
                         " bytes of shared memory per block, the device allows " + std::to_string(limit) +
                         " (the kernels are built for Hopper, 232448 bytes)");
  }
  return {};
}

Status check_grid(std::int64_t blocks, const char* what) {
  if (blocks > INT_MAX) {
    return Status::error(std::string("kda (CUDA): ") + what + " has " + std::to_string(blocks) +
                         " work items, more than one launch takes (2^31 - 1)");
  }
  return {};
}

Status finish(void* stream) {
  if (!env_flag("KDA_CUDA_SYNC")) return {};
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return cuda_failure("the kernels of the call", e);
  return {};
}

constexpr ForwardLauncher kForwardLaunchers[] = {
    launch_forward_k64_f32,   launch_forward_k64_bf16, launch_forward_k64_f16, launch_forward_k128_f32,
    launch_forward_k128_bf16, launch_forward_k128_f16, launch_forward_generic,
};
static_assert(sizeof(kForwardLaunchers) / sizeof(kForwardLaunchers[0]) == static_cast<int>(FwdKernel::kCount));

Status stage_forward_indices(ForwardParams* hp, std::vector<std::vector<unsigned char>>* keep) {
  KDA_RETURN_IF_ERROR(stage_index("cu_seqlens", &hp->cu_seqlens, keep));
  KDA_RETURN_IF_ERROR(stage_index("segment_ids", &hp->segment_ids, keep));
  KDA_RETURN_IF_ERROR(stage_index("initial_state_indices", &hp->initial_state_indices, keep));
  return {};
}

const char kBackwardUnsupported[] =
    "kda (CUDA): chunk_backward with CUDA tensors is not supported yet (the CUDA backend has the forward, "
    "the inference forward and decode); run the backward on host tensors with the CPU backend";

}  // namespace

bool is_device_pointer(const void* p) {
  return pointer_info(p).device;
}

bool uses_device(const ForwardParams& f) {
  for (const TensorView* t :
       {&f.q, &f.k, &f.v, &f.g, &f.beta, &f.A_log, &f.dt_bias, &f.cu_seqlens, &f.segment_ids, &f.initial_state,
        &f.initial_state_indices, &f.o, &f.final_state, &f.chunk_states, &f.v_new})
    if (t->defined() && is_device_pointer(t->data)) return true;
  return false;
}

bool uses_device(const BackwardParams& b) {
  if (uses_device(b.forward)) return true;
  for (const TensorView* t :
       {&b.d_o, &b.d_final_state, &b.dq, &b.dk, &b.dv, &b.dg, &b.dbeta, &b.dh0, &b.dA_log, &b.ddt_bias})
    if (t->defined() && is_device_pointer(t->data)) return true;
  return false;
}

bool uses_device(const DecodeParams& d) {
  for (const TensorView* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.A_log, &d.dt_bias, &d.state_pool, &d.slot_indices,
                              &d.num_accepted_tokens, &d.o})
    if (t->defined() && is_device_pointer(t->data)) return true;
  return false;
}

std::optional<std::string> why_unsupported_cuda(const ForwardParams& params) {
  // v_new is the CPU backward's residual; the CUDA forward does not form it as rows yet.
  if (params.v_new.defined())
    return std::string(
        "kda (CUDA): argument 'v_new' is not supported by the CUDA forward yet (the CPU backend writes it)");
  return why_unsupported_sizes(params.q.shape[3], params.v.shape[3]);
}

std::optional<std::string> why_unsupported_cuda(const BackwardParams&) {
  return std::string(kBackwardUnsupported);
}

std::optional<std::string> why_unsupported_cuda(const DecodeParams& params) {
  // state_tile_out writes fp32 (the CPU backend also takes bf16 / fp16 pools).
  if (params.state_pool.dtype != DType::kF32)
    return "kda (CUDA): argument 'state_pool': expected dtype float32 on the CUDA backend, got " +
           std::string(dtype_name(params.state_pool.dtype)) +
           " (bf16 / fp16 pools are decoded by the CPU backend only)";
  return why_unsupported_sizes(params.q.shape[3], params.v.shape[3]);
}

Status chunk_forward(const ForwardParams& prm) {
  ForwardParams hp = prm;
  std::vector<std::vector<unsigned char>> keep;
  KDA_RETURN_IF_ERROR(stage_forward_indices(&hp, &keep));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_forward(hp, /*oracle=*/false, &p));
  if (auto why = why_unsupported_cuda(prm)) return Status::error(*why);
  const Arg args[] = {{"q", &prm.q},
                      {"k", &prm.k},
                      {"v", &prm.v},
                      {"g", &prm.g},
                      {"beta", &prm.beta},
                      {"A_log", &prm.A_log},
                      {"dt_bias", &prm.dt_bias},
                      {"initial_state", &prm.initial_state},
                      {"o", &prm.o},
                      {"final_state", &prm.final_state},
                      {"chunk_states", &prm.chunk_states}};
  int device = -1;
  KDA_RETURN_IF_ERROR(require_device(args, &device));
  DeviceGuard guard(device);
  void* stream = prm.options.cuda_stream;

  const FwdKernel kernel = force_generic() ? FwdKernel::kGeneric : select_forward_kernel(p, prm);
  const FwdKernelInfo& info = kernel_info(kernel);
  FwdPlan plan;
  prepare_forward(prm, p, kernel, &plan);
  KDA_RETURN_IF_ERROR(check_grid(plan.args.num_items, "the forward"));
  KDA_RETURN_IF_ERROR(check_grid(plan.pad.num_rows, "the padding of the forward"));
  DeviceTable segs(stream), rows(stream);
  if (plan.args.num_items > 0) {
    const std::int64_t smem = fwd_layout(plan.args.C, plan.args.K, info.vt).total;
    KDA_RETURN_IF_ERROR(check_shared_memory(smem, device, std::string("forward ") + info.name));
    KDA_RETURN_IF_ERROR(segs.upload(plan.segs, "segment table"));
    plan.args.segs = segs.get<DSeg>();
    const int e = kForwardLaunchers[static_cast<int>(kernel)](plan.args, static_cast<std::size_t>(smem), stream);
    if (e != cudaSuccess) return cuda_failure(std::string("launching the forward kernel ") + info.name, e);
  }
  if (plan.pad.num_rows > 0) {
    KDA_RETURN_IF_ERROR(rows.upload(plan.pad_rows, "padding rows"));
    plan.pad.rows = rows.get<DRow>();
    const int e = launch_zero_padding(plan.pad, stream);
    if (e != cudaSuccess) return cuda_failure("launching the padding kernel", e);
  }
  return finish(stream);
}

Status decode(const DecodeParams& prm) {
  DecodeParams hp = prm;
  std::vector<std::vector<unsigned char>> keep;
  KDA_RETURN_IF_ERROR(stage_index("slot_indices", &hp.slot_indices, &keep));
  KDA_RETURN_IF_ERROR(stage_index("num_accepted_tokens", &hp.num_accepted_tokens, &keep));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_decode(hp, &p));
  if (auto why = why_unsupported_cuda(prm)) return Status::error(*why);
  const Arg args[] = {{"q", &prm.q},
                      {"k", &prm.k},
                      {"v", &prm.v},
                      {"g", &prm.g},
                      {"beta", &prm.beta},
                      {"A_log", &prm.A_log},
                      {"dt_bias", &prm.dt_bias},
                      {"state_pool", &prm.state_pool},
                      {"o", &prm.o}};
  int device = -1;
  KDA_RETURN_IF_ERROR(require_device(args, &device));
  DeviceGuard guard(device);
  void* stream = prm.options.cuda_stream;

  DecPlan plan;
  prepare_decode(prm, p, &plan);
  KDA_RETURN_IF_ERROR(check_grid(plan.args.num_items, "decode"));
  if (plan.args.num_items == 0) return {};
  const std::int64_t smem = dec_layout(plan.args.K).total;
  KDA_RETURN_IF_ERROR(check_shared_memory(smem, device, "decode"));
  DeviceTable read(stream), write(stream);
  KDA_RETURN_IF_ERROR(read.upload(plan.read, "read slots"));
  KDA_RETURN_IF_ERROR(write.upload(plan.write, "write slots"));
  plan.args.read = read.get<std::int64_t>();
  plan.args.write = write.get<std::int64_t>();
  const int e = launch_decode(plan.args, static_cast<std::size_t>(smem), stream);
  if (e != cudaSuccess) return cuda_failure("launching the decode kernel", e);
  return finish(stream);
}

Status validate_backward(const BackwardParams& prm) {
  BackwardParams hp = prm;
  std::vector<std::vector<unsigned char>> keep;
  KDA_RETURN_IF_ERROR(stage_forward_indices(&hp.forward, &keep));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_backward(hp, /*oracle=*/false, &p));
  if (auto why = why_unsupported_cuda(prm)) return Status::error(*why);
  return {};
}

Status chunk_backward(const BackwardParams& prm) {
  return cuda::validate_backward(prm);
}

Status forward_chunk_count(const ForwardParams& prm, std::int64_t* num_chunks) {
  ForwardParams hp = prm;
  std::vector<std::vector<unsigned char>> keep;
  KDA_RETURN_IF_ERROR(stage_forward_indices(&hp, &keep));
  hp.chunk_states = TensorView{};
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_forward(hp, /*oracle=*/true, &p, /*backward=*/true));
  *num_chunks = p.num_chunks;
  return {};
}

}  // namespace kda::cuda

// Entry points of the CUDA backend for the public operations (src/cpu/dispatch.cpp routes a call
// here when its tensors are device memory). Declared without CUDA headers. Compiled only with
// KDA_HAVE_CUDA (CMakeLists.txt, KDA_CUDA).
//
// Contract (docs/CUDA.md): validation runs on the host with the CPU path's rules
// (detail::plan_forward / plan_decode); index tensors (cu_seqlens, segment_ids,
// initial_state_indices, slot_indices, num_accepted_tokens) may be host or device memory and are
// copied to the host for it; every other tensor must be device memory of one device. Kernels are
// queued on options.cuda_stream (null: the legacy default stream) and the call returns without
// waiting for them, like a framework op; with the environment variable KDA_CUDA_SYNC=1 it waits
// and reports kernel errors in its Status.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kda/ops.hpp"

namespace kda::cuda {

// True for device (or managed) memory of a usable CUDA device; false for host memory, null, or
// when no CUDA driver or device is usable.
bool is_device_pointer(const void* p);

// Whether a call belongs to the CUDA backend: any of its data tensors is device memory.
bool uses_device(const ForwardParams& params);
bool uses_device(const BackwardParams& params);
bool uses_device(const DecodeParams& params);

// Why the CUDA backend cannot run a call (nullopt: it can). Checked after validation, so a
// malformed call gets the validation message.
std::optional<std::string> why_unsupported_cuda(const ForwardParams& params);
std::optional<std::string> why_unsupported_cuda(const BackwardParams& params);
std::optional<std::string> why_unsupported_cuda(const DecodeParams& params);

Status chunk_forward(const ForwardParams& params);
Status decode(const DecodeParams& params);
Status chunk_backward(const BackwardParams& params);     // not supported yet: says so
Status validate_backward(const BackwardParams& params);  // validation, then the same answer
Status forward_chunk_count(const ForwardParams& params, std::int64_t* num_chunks);

}  // namespace kda::cuda

// The CUDA backend's public corner (docs/CUDA.md). The operations of kda/ops.hpp run on the GPU
// when their tensors are device memory (the CUDA backend is built with KDA_CUDA, see
// CMakeLists.txt); this header adds what only a GPU caller needs: whether the backend is there,
// and the device-memory accounting allocator that measures peak device memory (SPEC.md
// section 5), the GPU twin of kda/memory.hpp.
//
// Without the CUDA backend (KDA_CUDA=OFF or no CUDA compiler at build time) the library cannot
// tell device pointers from host pointers: only host pointers may be passed, and these
// functions report no device.
#pragma once

#include <cstddef>
#include <string>

#include "kda/memory.hpp"

namespace kda {

// True when the library was built with the CUDA backend.
bool cuda_built();

// Number of usable CUDA devices: 0 without the backend, without a driver or without a device,
// with the reason in *why (e.g. "no CUDA device: CUDA driver version is insufficient ...").
int cuda_device_count(std::string* why = nullptr);

// Device memory through the accounting allocator, ordered on `stream` (a cudaStream_t; null:
// the legacy default stream). Returns nullptr on failure or without the CUDA backend. The
// library allocates its own device temporaries here, and callers may allocate their tensors
// here too, so that the peak covers a whole call.
void* cuda_allocate(std::size_t bytes, void* stream = nullptr);
void cuda_deallocate(void* ptr, void* stream = nullptr) noexcept;

// Bytes currently allocated and the peak since the last reset.
MemoryStats cuda_memory_stats();
void cuda_reset_peak_memory();

}  // namespace kda

// The device-memory accounting allocator (include/kda/cuda.hpp): stream-ordered cudaMallocAsync /
// cudaFreeAsync with the size of every live block in a table, so current and peak bytes are
// measured. The table is guarded by a mutex; allocations are per call, not per kernel.
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "kda/cuda.hpp"

namespace kda {
namespace {

struct Block {
  std::size_t bytes = 0;
  bool stream_ordered = true;  // cudaMallocAsync (else cudaMalloc)
};

std::mutex g_mutex;
std::unordered_map<void*, Block>& blocks() {
  static auto* table = new std::unordered_map<void*, Block>();  // outlives static destructors
  return *table;
}
std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};

}  // namespace

bool cuda_built() {
  return true;
}

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    if (why) *why = std::string("no CUDA device: ") + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")";
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device: cudaGetDeviceCount reported 0 devices";
  return n;
}

void* cuda_allocate(std::size_t bytes, void* stream) {
  void* p = nullptr;
  const std::size_t n = bytes > 0 ? bytes : 1;  // a unique pointer for size 0
  bool stream_ordered = true;
  cudaError_t e = cudaMallocAsync(&p, n, static_cast<cudaStream_t>(stream));
  if (e == cudaErrorNotSupported) {  // no memory pools on this device or driver
    cudaGetLastError();
    stream_ordered = false;
    e = cudaMalloc(&p, n);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    blocks()[p] = Block{bytes, stream_ordered};
  }
  const std::int64_t now = g_current.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  std::int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void cuda_deallocate(void* ptr, void* stream) noexcept {
  if (ptr == nullptr) return;
  Block block;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = blocks().find(ptr);
    if (it == blocks().end()) return;  // not ours
    block = it->second;
    blocks().erase(it);
  }
  g_current.fetch_sub(static_cast<std::int64_t>(block.bytes));
  const cudaError_t e = block.stream_ordered ? cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)) : cudaFree(ptr);
  if (e != cudaSuccess) cudaGetLastError();
}

MemoryStats cuda_memory_stats() {
  return {g_current.load(), g_peak.load()};
}

void cuda_reset_peak_memory() {
  g_peak.store(g_current.load());
}

}  // namespace kda

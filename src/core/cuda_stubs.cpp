// kda/cuda.hpp when the library is built without the CUDA backend (KDA_CUDA=OFF, or no CUDA
// compiler at configure time): no device, and only host pointers are accepted by every
// operation (without the CUDA runtime a device pointer cannot be recognized; see docs/CUDA.md).
#include "kda/cuda.hpp"

namespace kda {

bool cuda_built() {
  return false;
}

int cuda_device_count(std::string* why) {
  if (why) *why = "libkda was built without the CUDA backend (KDA_CUDA=OFF or no CUDA compiler at configure time)";
  return 0;
}

void* cuda_allocate(std::size_t, void*) {
  return nullptr;
}
void cuda_deallocate(void*, void*) noexcept {}
MemoryStats cuda_memory_stats() {
  return {};
}
void cuda_reset_peak_memory() {}

}  // namespace kda

// The accounting allocator. Every tensor-sized buffer the library allocates (scratch,
// intermediates) goes through it, so peak memory
// is measured rather than estimated (SPEC.md section 5). Callers (benchmarks, bindings) may use
// it for their own tensors to get one number for a whole call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kda {

struct MemoryStats {
  std::int64_t current_bytes = 0;
  std::int64_t peak_bytes = 0;
};

// 64-byte aligned; returns nullptr on failure (size 0 gives a valid unique pointer).
void* allocate(std::size_t bytes);
void deallocate(void* ptr) noexcept;

MemoryStats memory_stats();
// Sets the peak to the current usage, so the next peak is measured from here.
void reset_peak_memory();

struct Deallocator {
  void operator()(void* p) const noexcept { deallocate(p); }
};
using Buffer = std::unique_ptr<void, Deallocator>;

}  // namespace kda

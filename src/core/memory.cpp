// The accounting allocator (include/kda/memory.hpp). A 64-byte header before each block keeps
// its size so deallocate can account without a lookup table.
#include <atomic>
#include <cstdlib>

#include "kda/memory.hpp"

namespace kda {
namespace {
constexpr std::size_t kAlign = 64;
std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};
}  // namespace

void* allocate(std::size_t bytes) {
  std::size_t total = kAlign + ((bytes + kAlign - 1) / kAlign) * kAlign;
  void* raw = std::aligned_alloc(kAlign, total);
  if (raw == nullptr) return nullptr;
  *static_cast<std::size_t*>(raw) = bytes;
  std::int64_t now = g_current.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  std::int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  return static_cast<char*>(raw) + kAlign;
}

void deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return;
  void* raw = static_cast<char*>(ptr) - kAlign;
  g_current.fetch_sub(static_cast<std::int64_t>(*static_cast<std::size_t*>(raw)));
  std::free(raw);
}

MemoryStats memory_stats() { return {g_current.load(), g_peak.load()}; }

void reset_peak_memory() { g_peak.store(g_current.load()); }

}  // namespace kda

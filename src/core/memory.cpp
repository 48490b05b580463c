// The accounting allocator (include/kda/memory.hpp). A 64-byte header before each block keeps
// its size so deallocate can account without a lookup table.
#include <atomic>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kda/memory.hpp"

namespace kda {
namespace {
constexpr std::size_t kAlign = 64;
std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};
}  // namespace

// Tensor-sized blocks (states pools, staged intermediates, scratch of many threads) are 2 MB
// aligned and offered to transparent huge pages: with 4 KB pages, walking 64 KB states of a
// pool in slot order costs a TLB miss every 4 KB.
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kHugeThreshold = std::size_t{4} << 20;

void* allocate(std::size_t bytes) {
  std::size_t total = kAlign + ((bytes + kAlign - 1) / kAlign) * kAlign;
  const bool huge = total >= kHugeThreshold;
  if (huge) total = (total + kHugePage - 1) / kHugePage * kHugePage;
  void* raw = std::aligned_alloc(huge ? kHugePage : kAlign, total);
  if (raw == nullptr) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(raw, total, MADV_HUGEPAGE);  // advisory: failure changes nothing
#endif
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

MemoryStats memory_stats() {
  return {g_current.load(), g_peak.load()};
}

void reset_peak_memory() {
  g_peak.store(g_current.load());
}

}  // namespace kda

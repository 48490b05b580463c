// The floating-point mode every kernel thread computes in.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace kda::detail {

// IEEE arithmetic for the scope, whatever the calling thread's mode: round to nearest, denormals
// kept (neither flush-to-zero nor denormals-are-zero), every exception masked. Restored on exit,
// with any exception flags raised in between kept raised.
//
// Why: a thread inherits its creator's MXCSR. An OpenMP pool first started from a thread that
// flushes denormals (XLA's CPU threads do while they run a computation, custom calls included)
// keeps flushing in its workers, while the calling thread of a later call (Python's main thread)
// does not; with dynamic scheduling a work item's result then depended on which thread took it,
// which broke batch invariance and run-to-run equality (seen: dg of a packed run differing from the
// same sequences run alone, bitwise, after the JAX tests had run in the same process).
class ScopedIeeeMode {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  ScopedIeeeMode() : saved_(_mm_getcsr()) {
    _mm_setcsr(kIeee | (saved_ & kFlags));
  }
  ~ScopedIeeeMode() {
    _mm_setcsr((saved_ & ~kFlags) | (_mm_getcsr() & kFlags));
  }

 private:
  static constexpr unsigned kIeee = 0x1f80;  // all exceptions masked, round to nearest, no FTZ / DAZ
  static constexpr unsigned kFlags = 0x3f;   // the sticky exception flags
  unsigned saved_;
#else
  ScopedIeeeMode() = default;  // other ISAs: the default environment is assumed
#endif
  ScopedIeeeMode(const ScopedIeeeMode&) = delete;
  ScopedIeeeMode& operator=(const ScopedIeeeMode&) = delete;
};

}  // namespace kda::detail

// The floating-point mode every kernel thread computes in.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace kda::detail {

// The MXCSR modes the library computes in: plain IEEE (the fp64 oracle), and the kernels' mode,
// which flushes denormals (FTZ: a result below FLT_MIN becomes 0; DAZ: a denormal operand reads as
// 0). Both round to nearest with every exception masked.
enum class FpMode : unsigned {
  kIeee = 0x1f80,            // all exceptions masked, round to nearest, no FTZ / DAZ
  kFlushDenormals = 0x9fc0,  // the same with FTZ (bit 15) and DAZ (bit 6)
};

// kMode for the scope, whatever the calling thread's mode; restored on exit, with any exception
// flags raised in between kept raised.
//
// Why a fixed mode at all: a thread inherits its creator's MXCSR. An OpenMP pool first started from
// a thread that flushes denormals (XLA's CPU threads do while they run a computation, custom calls
// included) keeps flushing in its workers, while the calling thread of a later call (Python's main
// thread) does not; with dynamic scheduling a work item's result then depended on which thread took
// it, which broke batch invariance and run-to-run equality (seen: dg of a packed run differing from
// the same sequences run alone, bitwise, after the JAX tests had run in the same process).
//
// Why the kernels flush: Intel cores take a microcode assist (on the order of 100 cycles) for every
// vector operation with a denormal operand or result, and the chunked products make denormals
// routinely: a 64-token chunk's decay spans e^0 down to e^-100 and below, so the far entries of
// Aqk, L, Qg and Kb pass through the denormal range. On this project's Emerald Rapids the staged
// forward took 2564 ms in IEEE mode against 469 ms flushing, and the fused bf16 forward 280-314
// against 244 (docs/PERF.md, thirtieth session); AMD's Zen cores handle denormals without assists
// and lose nothing. Values below FLT_MIN (1.2e-38) are far below what SPEC.md 4's relative bounds
// can see, as XLA's CPU backend and GPU kernels (which flush in their fp32 fast paths) assume too.
// Other ISAs keep their default environment (AArch64 cores handle denormals at full speed).
template <FpMode kMode>
class ScopedFpMode {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  ScopedFpMode() : saved_(_mm_getcsr()) {
    _mm_setcsr(static_cast<unsigned>(kMode) | (saved_ & kFlags));
  }
  ~ScopedFpMode() {
    _mm_setcsr((saved_ & ~kFlags) | (_mm_getcsr() & kFlags));
  }

 private:
  static constexpr unsigned kFlags = 0x3f;  // the sticky exception flags
  unsigned saved_;
#else
  ScopedFpMode() = default;  // other ISAs: the default environment is assumed
#endif
  ScopedFpMode(const ScopedFpMode&) = delete;
  ScopedFpMode& operator=(const ScopedFpMode&) = delete;
};

using ScopedIeeeMode = ScopedFpMode<FpMode::kIeee>;              // the fp64 oracle
using ScopedKernelMode = ScopedFpMode<FpMode::kFlushDenormals>;  // every CPU kernel thread

}  // namespace kda::detail

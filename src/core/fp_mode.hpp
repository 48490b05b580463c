// The floating-point mode every kernel thread computes in.
#pragma once

#include <cstdint>

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
// AArch64 gets the same two modes through FPCR (FZ flushes denormal operands and results alike), so
// that a denormal reads as zero on every CPU the library targets; other ISAs keep their default
// environment (KDA_KERNELS_FLUSH_DENORMALS says which).
#if defined(__SSE__) || defined(__x86_64__) || defined(__aarch64__)
#define KDA_KERNELS_FLUSH_DENORMALS 1
#else
#define KDA_KERNELS_FLUSH_DENORMALS 0
#endif
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
#elif defined(__aarch64__)
  // FPCR: FZ (bit 24), default NaN (25), rounding mode (22-23) and the trap enables (8-12, 15)
  // are set; the exception flags live in FPSR and are left alone.
  ScopedFpMode() : saved_(read_fpcr()) {
    const std::uint64_t fz = kMode == FpMode::kFlushDenormals ? kFz : 0;
    write_fpcr((saved_ & ~kControlled) | fz);
  }
  ~ScopedFpMode() {
    write_fpcr(saved_);
  }

 private:
  static constexpr std::uint64_t kFz = std::uint64_t{1} << 24;
  static constexpr std::uint64_t kControlled =
      kFz | (std::uint64_t{1} << 25) | (std::uint64_t{3} << 22) | (std::uint64_t{0x1f} << 8) | (std::uint64_t{1} << 15);
  static std::uint64_t read_fpcr() {
    std::uint64_t v;
    asm volatile("mrs %0, fpcr" : "=r"(v));
    return v;
  }
  static void write_fpcr(std::uint64_t v) {
    asm volatile("msr fpcr, %0" : : "r"(v));
  }
  std::uint64_t saved_;
#else
  ScopedFpMode() {}  // other ISAs: the default environment is assumed (user-provided: no unused warning)
#endif
  ScopedFpMode(const ScopedFpMode&) = delete;
  ScopedFpMode& operator=(const ScopedFpMode&) = delete;
};

using ScopedIeeeMode = ScopedFpMode<FpMode::kIeee>;              // the fp64 oracle
using ScopedKernelMode = ScopedFpMode<FpMode::kFlushDenormals>;  // every CPU kernel thread

}  // namespace kda::detail

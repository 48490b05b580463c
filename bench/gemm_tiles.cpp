// kda-gemm-tiles: GFLOP/s of one thread on the small products the CPU kernels run, through the
// kernels' own gemm (src/cpu/simd.hpp, which picks the register tile by gemm_tile_rows) and
// through each fixed tile shape, operands in L1/L2 as in the kernels. This is the evidence for
// gemm_tile_rows' choices (docs/PERF.md, fourteenth session); rerun it when the tiles or the
// compiler change.
//
//   kda-gemm-tiles [--reps N]
//
// Each figure is the best of 7 timings of N calls. Built twice: kda-gemm-tiles for the kernels'
// avx512 target (the bf16 rows need AVX512_BF16, and are skipped with a note without it), and
// kda-gemm-tiles-avx2 (KDA_VECTOR_BYTES = 32) for their avx2 target, fp32 rows only.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(KDA_VECTOR_BYTES) || KDA_VECTOR_BYTES == 64
#define KDA_BF16_DOT 1
#endif
namespace kda_tiles {
#include "cpu/simd.hpp"

// C (m, n) += A B over whole MR x NV tiles only (m a multiple of MR, n of 16 NV).
template <int MR, int NV, typename Op>
__attribute__((noinline)) void fixed_tiles(std::int64_t m, std::int64_t n, std::int64_t kd, const typename Op::A* a,
                                           std::int64_t ars, std::int64_t acs, const float* b, float* c,
                                           const float* c_scale) {
  for (std::int64_t i = 0; i + MR <= m; i += MR)
    for (std::int64_t j = 0; j + NV * kLanes <= n; j += NV * kLanes)
      gemm_tile<MR, NV, Op>(kd, a + i * ars, ars, acs, b + j, n, c + i * n + j, n, 1e-3f,
                            c_scale ? c_scale + i : nullptr, nullptr);
}

// The tiles before gemm_tile_rows: 6-row tiles (6 x 4, 6 x 2, 6 x 1 vectors; up to 6 x 2 with
// 8 lanes), the last rows in a smaller tile.
template <typename Op>
__attribute__((noinline)) void six_row_gemm(std::int64_t m, std::int64_t n, std::int64_t kd, const typename Op::A* a,
                                            std::int64_t ars, std::int64_t acs, const float* b, float* c,
                                            const float* c_scale) {
  for (std::int64_t i = 0; i < m; i += 6)
    gemm_rows_upto<6, Op>(std::min<std::int64_t>(6, m - i), n, kd, a + i * ars, ars, acs, b, n, c + i * n, n, 1e-3f,
                          c_scale ? c_scale + i : nullptr, nullptr);
}

template <typename Op>
__attribute__((noinline)) void library_gemm(std::int64_t m, std::int64_t n, std::int64_t kd, const typename Op::A* a,
                                            std::int64_t ars, std::int64_t acs, const float* b, float* c,
                                            const float* c_scale) {
  gemm<Op>(m, n, kd, a, ars, acs, b, n, c, n, 1e-3f, Tri::kFull, c_scale);
}
}  // namespace kda_tiles

namespace {

#ifdef KDA_BF16_DOT
using kda_tiles::Bf16Dot;
#endif
using kda_tiles::F32Fma;

struct Shape {
  const char* what;
  std::int64_t m, n, kd;  // kd: fp32 elements or bf16 pairs
  bool a_transposed;      // A(i, p) = a[i + p m] (a column operand) instead of a[i kd + p]
  bool scaled;            // C = diag(s) C + A B, as the state updates
};

template <class F>
double best_ns(F&& f, int reps) {
  double best = 1e30;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / reps;
}

template <typename Op>
void run(const std::vector<Shape>& shapes, int reps, const char* kind) {
  using A = typename Op::A;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.01f, 0.01f);
  std::vector<A> a(256 * 256);
  std::vector<float> b(256 * 256), c(256 * 256, 0.0f), scale(256, 0.99f);
  for (auto& x : b) x = u(rng);
  for (auto& x : a) {
    if constexpr (std::is_same_v<A, float>) {
      x = u(rng);
    } else {  // two bf16 values per word, as pack_rows_bf16 writes them
      const float lo = u(rng), hi = u(rng);
      std::uint32_t l, h;
      std::memcpy(&l, &lo, 4), std::memcpy(&h, &hi, 4);
      x = (l >> 16) | (h & 0xffff0000u);
    }
  }
  if constexpr (!std::is_same_v<Op, F32Fma>) {  // Bf16Dot: b holds bf16 pairs too
    for (auto& x : b) {
      std::uint32_t w;
      std::memcpy(&w, &x, 4);
      w = (w >> 16) | (w & 0xffff0000u);
      std::memcpy(&x, &w, 4);
    }
  }
  std::printf("\n%s products, GFLOP/s of one thread (best of 7 x %d calls):\n", kind, reps);
  std::printf("| product | m x n x kd | gemm | 6-row tiles | 4 x 4 | 2 x 4 | 8 x 2 | 4 x 2 | 8 x 1 |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const double flop_per_kd = std::is_same_v<Op, F32Fma> ? 2.0 : 4.0;
  for (const Shape& s : shapes) {
    const std::int64_t ars = s.a_transposed ? 1 : s.kd, acs = s.a_transposed ? s.m : 1;
    const float* cs = s.scaled ? scale.data() : nullptr;
    const double flop = flop_per_kd * static_cast<double>(s.m * s.n * s.kd);
    auto gflops = [&](auto fn, std::int64_t mr, std::int64_t nv) -> std::string {
      if (s.m % mr != 0 || s.n % (kda_tiles::kLanes * nv) != 0) return "-";
      const double ns = best_ns([&] { fn(s.m, s.n, s.kd, a.data(), ars, acs, b.data(), c.data(), cs); }, reps);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.1f", flop / ns);
      return buf;
    };
    using kda_tiles::fixed_tiles;
    std::printf("| %s | %ld x %ld x %ld | %s | %s | %s | %s | %s | %s | %s |\n", s.what, static_cast<long>(s.m),
                static_cast<long>(s.n), static_cast<long>(s.kd), gflops(kda_tiles::library_gemm<Op>, 1, 1).c_str(),
                gflops(kda_tiles::six_row_gemm<Op>, 1, 1).c_str(), gflops(fixed_tiles<4, 4, Op>, 4, 4).c_str(),
                gflops(fixed_tiles<2, 4, Op>, 2, 4).c_str(), gflops(fixed_tiles<8, 2, Op>, 8, 2).c_str(),
                gflops(fixed_tiles<4, 2, Op>, 4, 2).c_str(), gflops(fixed_tiles<8, 1, Op>, 8, 1).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20000;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: kda-gemm-tiles [--reps N]\n");
      return 2;
    }
  }
#ifdef KDA_BF16_DOT
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    std::printf(
        "kda-gemm-tiles: this CPU lacks AVX-512 (kda-gemm-tiles-avx2 times the avx2 target): nothing to time\n");
    return 0;
  }
#else
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("kda-gemm-tiles-avx2: this CPU lacks AVX2 + FMA: nothing to time\n");
    return 0;
  }
  std::printf("8-lane vectors (the avx2 target): a tile of NV vectors is 8 NV columns wide\n");
#endif
  // The representative shape's products (K = V = 128, 16-token blocks): SPEC.md section 5.
  run<F32Fma>({{"dAqk = dO Vn^T", 16, 16, 128, false, false},
               {"dL = [Mu | Mw] [U | W]^T", 16, 16, 256, false, false},
               {"gated-product adjoint, x side", 32, 128, 16, false, false},
               {"gated-product adjoint, y side", 16, 128, 32, true, false},
               {"Aqk Vn, Aqk^T dO", 16, 128, 16, false, false},
               {"fp32 path: W S0, Qg S0", 16, 128, 128, false, false},
               {"fp32 path: state update", 128, 128, 16, true, true}},
              reps, "fp32 (F32Fma)");
#ifdef KDA_BF16_DOT
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("\nbf16 rows skipped: this CPU lacks AVX512_BF16\n");
    return 0;
  }
  run<Bf16Dot>({{"W S0, Qg S0, Kb dS1, T1, dKb, dW", 16, 128, 64, false, false},
                {"state update (forward, sweep)", 128, 128, 8, true, true},
                {"dS update [Qg; W]^T [dO; -dVn]", 128, 128, 16, true, true},
                {"a 32-column product", 128, 32, 64, true, false}},
               reps, "bf16 pair dot products (Bf16Dot)");
#endif
  return 0;
}

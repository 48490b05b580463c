// kda-backward-alone: times kda::chunk_backward (saved-state policy) or kda::chunk_forward alone
// on the representative shape (SPEC.md section 5: B=1, T=8192, H=32, K=V=128, bf16, gate in kernel
// with lower_bound = -5, qk l2norm), for side-by-side A/B runs of one kernel: kda-bench times the
// training step as a whole. The forward runs once first to fill the residual.
//
//   kda-backward-alone [backward|forward] [--residual] [--head-first] [--v-new] [--iters N] [--tokens T] [--heads H]
//                      [--checksum]
//
// --head-first lays q, k, v, g, d_o and the gradients out as [B, H, T, D] (rows of one head
// contiguous, which the hardware prefetcher streams): the bound for token-row prefetching.
// --v-new adds the forward's v_new to the residual (the backward reads Vn instead of forming it).
// --residual: the forward alone writes the residual too (chunk states, and v_new with --v-new), as
// the forward of a training step does.
// --checksum: also prints an FNV-1a hash of every output's bytes (o and the final state, plus the
// gradients for backward), so a change meant to keep results bitwise can be checked in one run.
// Prints the min and median milliseconds.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <kda/kda.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bench_tensor.hpp"

namespace {

using kda_bench::fill;
using kda_bench::Tensor;

// A [B, T, H, D] tensor laid out as [B, H, T, D] in memory (rows of one head contiguous).
Tensor head_first(Tensor t) {
  const std::int64_t T = t.view.shape[1], D = t.view.shape[3];
  t.view.strides[2] = T * D;
  t.view.strides[1] = D;
  return t;
}

void check(const kda::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "kda-backward-alone: %s\n", s.message().c_str());
    std::exit(1);
  }
}

// FNV-1a over a tensor's bytes.
std::uint64_t fnv1a(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.buf.get());
  std::uint64_t h = 1469598103934665603ull;
  const std::size_t n = static_cast<std::size_t>(t.view.numel()) * kda::dtype_size(t.view.dtype);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  bool backward = true, head_first_layout = false, with_v_new = false, residual = false, checksum = false;
  int iters = 5;
  std::int64_t T = 8192, H = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "backward")
      backward = true;
    else if (a == "forward")
      backward = false;
    else if (a == "--residual")
      residual = true;
    else if (a == "--head-first")
      head_first_layout = true;
    else if (a == "--v-new")
      with_v_new = true;
    else if (a == "--checksum")
      checksum = true;
    else if (a == "--iters" && i + 1 < argc)
      iters = std::max(1, std::atoi(argv[++i]));
    else if (a == "--tokens" && i + 1 < argc)
      T = std::max(1, std::atoi(argv[++i]));
    else if (a == "--heads" && i + 1 < argc)
      H = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(
          stderr,
          "usage: kda-backward-alone [backward|forward] [--residual] [--head-first] [--v-new] [--iters N] [--tokens T] "
          "[--heads H] [--checksum]\n");
      return 2;
    }
  }
  const std::int64_t B = 1, K = 128, V = 128;
  const kda::DType bf16 = kda::DType::kBF16, f32 = kda::DType::kF32;
  // [B, T, H, D] as given, or head-first in memory
  auto token_rows = [&](std::initializer_list<std::int64_t> shape) {
    Tensor t(bf16, shape);
    return head_first_layout ? head_first(std::move(t)) : std::move(t);
  };
  Tensor q = token_rows({B, T, H, K}), k = token_rows({B, T, H, K}), v = token_rows({B, T, H, V}),
         g = token_rows({B, T, H, K}), o = token_rows({B, T, H, V});
  Tensor beta(bf16, {B, T, H}), A_log(f32, {H}), dt_bias(f32, {H * K}), h0(f32, {B, H, K, V}), ht(f32, {B, H, K, V});
  fill(q, -1, 1, 1), fill(k, -1, 1, 2), fill(v, -1, 1, 3), fill(g, -2, 2, 4), fill(beta, 0.05f, 0.95f, 5);
  fill(A_log, 0, 2.7f, 6), fill(dt_bias, -0.5f, 0.5f, 7), fill(h0, -0.1f, 0.1f, 8);
  kda::ForwardParams f;
  f.q = q.view, f.k = k.view, f.v = v.view, f.g = g.view, f.beta = beta.view, f.A_log = A_log.view;
  f.dt_bias = dt_bias.view, f.initial_state = h0.view, f.o = o.view, f.final_state = ht.view;
  f.options.use_qk_l2norm_in_kernel = true, f.options.use_gate_in_kernel = true;
  f.options.has_lower_bound = true, f.options.lower_bound = -5.0f;
  std::int64_t nc = 0;
  check(kda::forward_chunk_count(f, &nc));
  Tensor states(f32, {nc, H, K, V});
  const bool keep = backward || residual;  // the forward alone is timed without a residual unless asked
  if (keep) f.chunk_states = states.view;
  Tensor v_new(f32, {B, T, H, V});
  if (keep && with_v_new) f.v_new = v_new.view;
  Tensor d_o = token_rows({B, T, H, V}), dq = token_rows({B, T, H, K}), dk = token_rows({B, T, H, K}),
         dv = token_rows({B, T, H, V}), dg = token_rows({B, T, H, K});
  Tensor dht(f32, {B, H, K, V}), dbeta(bf16, {B, T, H}), dh0(f32, {B, H, K, V}), dA_log(f32, {H}),
      ddt_bias(f32, {H * K});
  fill(d_o, -1, 1, 9), fill(dht, -0.1f, 0.1f, 10);
  kda::BackwardParams bp;
  bp.d_o = d_o.view, bp.d_final_state = dht.view, bp.dq = dq.view, bp.dk = dk.view, bp.dv = dv.view;
  bp.dg = dg.view, bp.dbeta = dbeta.view, bp.dh0 = dh0.view, bp.dA_log = dA_log.view, bp.ddt_bias = ddt_bias.view;
  check(kda::chunk_forward(f));  // fills the residual, touches every output
  bp.forward = f;
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {  // no separate warm-up: the forward above touched everything
    const auto t0 = std::chrono::steady_clock::now();
    check(backward ? kda::chunk_backward(bp) : kda::chunk_forward(f));
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%s%s: min %.1f ms, median %.1f ms (%d runs)\n", backward ? "backward" : "forward",
              head_first_layout ? " (head-first)" : "", ms.front(), ms[ms.size() / 2], iters);
  if (checksum) {
    const std::pair<const char*, const Tensor*> outputs[] = {
        {"o", &o},   {"final_state", &ht}, {"dq", &dq},   {"dk", &dk},         {"dv", &dv},
        {"dg", &dg}, {"dbeta", &dbeta},    {"dh0", &dh0}, {"dA_log", &dA_log}, {"ddt_bias", &ddt_bias}};
    for (const auto& [name, t] : outputs)
      if (backward || t == &o || t == &ht)
        std::printf("checksum %s %016llx\n", name, static_cast<unsigned long long>(fnv1a(*t)));
  }
  return 0;
}

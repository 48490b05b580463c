// README's "C++ use" snippet, completed into a program against the installed headers and library:
// a packed bf16 forward with the in-kernel gate and l2norm, checked against the fp64 oracle
// (kda::reference_forward) with SPEC.md 4's bf16 bound, and one error naming its argument.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <kda/kda.hpp>
#include <string>
#include <vector>

namespace {

std::uint16_t to_bf16(float x) {  // round to nearest even
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace

int main() {
  const std::int64_t B = 1, T = 100, H = 2, K = 32, V = 32;
  std::uint32_t seed = 7;
  auto uniform = [&](float lo, float hi) {
    seed = seed * 1664525u + 1013904223u;
    return lo + (hi - lo) * static_cast<float>(seed >> 8) / 16777216.0f;
  };
  std::vector<std::uint16_t> q(B * T * H * K), k(q.size()), v(B * T * H * V), g(q.size()), beta(B * T * H);
  for (auto* x : {&q, &k, &v, &g})
    for (auto& e : *x) e = to_bf16(uniform(-1, 1));
  for (auto& e : beta) e = to_bf16(uniform(0.1f, 0.9f));
  std::vector<float> A_log(H, 0.5f), dt_bias(H * K, 0.1f);
  std::vector<std::int64_t> cu_seqlens = {0, 37, 100};
  std::vector<std::uint16_t> o(B * T * H * V);
  std::vector<float> ht(2 * H * K * V), o_ref(o.size()), ht_ref(ht.size());

  kda::ForwardParams p;
  p.q = kda::TensorView::contiguous(q.data(), kda::DType::kBF16, {B, T, H, K});
  p.k = kda::TensorView::contiguous(k.data(), kda::DType::kBF16, {B, T, H, K});
  p.v = kda::TensorView::contiguous(v.data(), kda::DType::kBF16, {B, T, H, V});
  p.g = kda::TensorView::contiguous(g.data(), kda::DType::kBF16, {B, T, H, K});
  p.beta = kda::TensorView::contiguous(beta.data(), kda::DType::kBF16, {B, T, H});
  p.cu_seqlens = kda::TensorView::contiguous(cu_seqlens.data(), kda::DType::kI64, {3});
  p.A_log = kda::TensorView::contiguous(A_log.data(), kda::DType::kF32, {H});
  p.dt_bias = kda::TensorView::contiguous(dt_bias.data(), kda::DType::kF32, {H * K});
  p.o = kda::TensorView::contiguous(o.data(), kda::DType::kBF16, {B, T, H, V});
  p.final_state = kda::TensorView::contiguous(ht.data(), kda::DType::kF32, {2, H, K, V});
  p.options.use_qk_l2norm_in_kernel = true;
  p.options.use_gate_in_kernel = true;
  p.options.has_lower_bound = true;
  p.options.lower_bound = -5.0f;
  kda::Status s = kda::chunk_forward(p);
  if (!s.ok()) {
    std::fprintf(stderr, "chunk_forward: %s\n", s.message().c_str());
    return 1;
  }
  kda::ForwardParams r = p;  // the oracle, fp32 outputs
  r.o = kda::TensorView::contiguous(o_ref.data(), kda::DType::kF32, {B, T, H, V});
  r.final_state = kda::TensorView::contiguous(ht_ref.data(), kda::DType::kF32, {2, H, K, V});
  s = kda::reference_forward(r);
  if (!s.ok()) {
    std::fprintf(stderr, "reference_forward: %s\n", s.message().c_str());
    return 1;
  }
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    const double d = from_bf16(o[i]) - o_ref[i];
    err += d * d, ref += static_cast<double>(o_ref[i]) * o_ref[i];
  }
  const double rel = std::sqrt(err / ref);
  std::printf("consumer: o rel %.3e against the fp64 oracle (bound 5e-3)\n", rel);
  if (!(rel <= 5e-3)) return 1;
  p.options.chunk_size = 48;  // an error names the argument, the expected and the actual value
  s = kda::chunk_forward(p);
  std::printf("consumer: chunk_size 48 -> %s\n", s.message().c_str());
  return !s.ok() && s.message().find("chunk_size") != std::string::npos ? 0 : 1;
}

// Public entry of the CPU forward: validation, the work plan, and the run-time choice of the
// instruction-set target.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/problem.hpp"
#include "cpu/cpu_plan.hpp"
#include "kda/kda.hpp"

namespace kda {
namespace {

enum class CpuTarget { kGeneric, kAvx512 };

CpuTarget detect_target() {
  const char* forced = std::getenv("KDA_CPU_TARGET");
  if (forced != nullptr && std::strcmp(forced, "generic") == 0) return CpuTarget::kGeneric;
#if defined(KDA_HAVE_AVX512_TARGET)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return CpuTarget::kAvx512;
  }
#endif
  return CpuTarget::kGeneric;
}

CpuTarget target() {
  static const CpuTarget t = detect_target();
  return t;
}

}  // namespace

const char* cpu_target() { return target() == CpuTarget::kAvx512 ? "avx512" : "generic"; }

Status chunk_forward(const ForwardParams& params) {
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_forward(params, /*oracle=*/false, &p));
  const std::int64_t nseg = static_cast<std::int64_t>(p.segments.size());
  std::vector<std::int64_t> order(static_cast<std::size_t>(nseg * p.HV));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return p.segments[a / p.HV].length > p.segments[b / p.HV].length;
  });
  std::vector<std::int64_t> row_offset(nseg), chunk_offset(nseg);
  cpu::CpuPlan plan;
  for (std::int64_t s = 0; s < nseg; ++s) {
    const std::int64_t chunks = (p.segments[s].length + p.chunk - 1) / p.chunk;
    row_offset[s] = plan.total_rows;
    chunk_offset[s] = plan.total_chunks;
    plan.total_rows += chunks * p.chunk;
    plan.total_chunks += chunks;
  }
  plan.order = order.data();
  plan.num_items = static_cast<std::int64_t>(order.size());
  plan.row_offset = row_offset.data();
  plan.chunk_offset = chunk_offset.data();
#if defined(KDA_HAVE_AVX512_TARGET)
  if (target() == CpuTarget::kAvx512) return cpu::avx512::forward(p, params, plan);
#endif
  return cpu::generic::forward(p, params, plan);
}

}  // namespace kda

// Public entry of the CPU forward: validation, the work plan, and the run-time choice of the
// instruction-set target.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "cpu/cpu_plan.hpp"
#include "kda/kda.hpp"

// Calls with device pointers go to the CUDA backend, which says why when it cannot run one
// (src/cuda/cuda_backend.hpp). Without it only host pointers are accepted (docs/CUDA.md).
#if defined(KDA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#define KDA_ROUTE_TO_CUDA(params, call) \
  if (::kda::cuda::uses_device(params)) return ::kda::cuda::call
#else
#define KDA_ROUTE_TO_CUDA(params, call) static_cast<void>(0)
#endif

namespace kda {
namespace {

enum class CpuTarget { kGeneric, kAvx2, kAvx512 };

struct TargetChoice {
  CpuTarget target = CpuTarget::kGeneric;
  std::string error;  // KDA_CPU_TARGET names no target this CPU runs: every kernel call fails with this
};

const char* target_name(CpuTarget t) {
  switch (t) {
    case CpuTarget::kAvx512:
      return "avx512";
    case CpuTarget::kAvx2:
      return "avx2";
    case CpuTarget::kGeneric:
      return "generic";
  }
  return "generic";
}

// The best target this CPU runs (avx512, else avx2, else generic), or the one KDA_CPU_TARGET
// names (tests run the suite on each target the CPU has). A name that is no target, or a target
// this CPU lacks, is an error of every kernel call rather than a silent fallback.
TargetChoice choose_target() {
  TargetChoice c;
  bool has_avx512 = false, has_avx2 = false;
#if defined(KDA_HAVE_X86_TARGETS)
  __builtin_cpu_init();
  has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
  has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  c.target = has_avx512 ? CpuTarget::kAvx512 : has_avx2 ? CpuTarget::kAvx2 : CpuTarget::kGeneric;
  const char* forced = std::getenv("KDA_CPU_TARGET");
  if (forced == nullptr || *forced == '\0') return c;
  if (std::strcmp(forced, "generic") == 0) {
    c.target = CpuTarget::kGeneric;
  } else if (std::strcmp(forced, "avx2") == 0 && has_avx2) {
    c.target = CpuTarget::kAvx2;
  } else if (std::strcmp(forced, "avx512") == 0 && has_avx512) {
    c.target = CpuTarget::kAvx512;
  } else if (std::strcmp(forced, "avx2") == 0 || std::strcmp(forced, "avx512") == 0) {
    c.error = std::string("environment variable KDA_CPU_TARGET: '") + forced +
              "' is not supported by this CPU (best: " + target_name(c.target) + ")";
  } else {
    c.error =
        std::string("environment variable KDA_CPU_TARGET: expected generic, avx2 or avx512, got '") + forced + "'";
  }
  return c;
}

const TargetChoice& choice() {
  static const TargetChoice c = choose_target();
  return c;
}

CpuTarget target() {
  return choice().target;
}

// Calls the kernel entry `fn` (forward, backward or decode) of the chosen target's namespace.
#if defined(KDA_HAVE_X86_TARGETS)
#define KDA_CALL_X86(fn, ...)                                              \
  if (target() == CpuTarget::kAvx512) return cpu::avx512::fn(__VA_ARGS__); \
  if (target() == CpuTarget::kAvx2) return cpu::avx2::fn(__VA_ARGS__)
#else
#define KDA_CALL_X86(fn, ...) static_cast<void>(0)
#endif
#define KDA_ON_CPU_TARGET(fn, ...)                                     \
  do {                                                                 \
    if (!choice().error.empty()) return Status::error(choice().error); \
    KDA_CALL_X86(fn, __VA_ARGS__);                                     \
    return cpu::generic::fn(__VA_ARGS__);                              \
  } while (0)

}  // namespace

const char* cpu_target() {
  return target_name(target());
}

// The work order and staged-buffer offsets of a validated problem.
struct PlanStorage {
  std::vector<std::int64_t> order, row_offset, chunk_segment;
  cpu::CpuPlan plan;
};

void build_plan(const detail::Problem& p, PlanStorage& st);

Status chunk_forward(const ForwardParams& params) {
  KDA_ROUTE_TO_CUDA(params, chunk_forward(params));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_forward(params, /*oracle=*/false, &p));
  PlanStorage st;
  build_plan(p, st);
  KDA_ON_CPU_TARGET(forward, p, params, st.plan);
}

Status decode(const DecodeParams& params) {
  KDA_ROUTE_TO_CUDA(params, decode(params));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_decode(params, &p));
  KDA_ON_CPU_TARGET(decode, p, params);
}

Status validate_backward(const BackwardParams& params) {
  KDA_ROUTE_TO_CUDA(params, validate_backward(params));
  detail::Problem p;
  return detail::plan_backward(params, /*oracle=*/false, &p);
}

Status chunk_backward(const BackwardParams& params) {
  KDA_ROUTE_TO_CUDA(params, chunk_backward(params));
  detail::Problem p;
  KDA_RETURN_IF_ERROR(detail::plan_backward(params, /*oracle=*/false, &p));
  PlanStorage st;
  build_plan(p, st);
  KDA_ON_CPU_TARGET(backward, p, params, st.plan);
}

void build_plan(const detail::Problem& p, PlanStorage& st) {
  std::vector<std::int64_t>& order = st.order;
  std::vector<std::int64_t>& row_offset = st.row_offset;
  cpu::CpuPlan& plan = st.plan;
  const std::int64_t nseg = static_cast<std::int64_t>(p.segments.size());
  order.resize(static_cast<std::size_t>(nseg * p.HV));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return p.segments[a / p.HV].length > p.segments[b / p.HV].length;
  });
  row_offset.resize(static_cast<std::size_t>(nseg));
  for (std::int64_t s = 0; s < nseg; ++s) row_offset[s] = p.chunk_offset[s] * p.chunk;
  plan.total_rows = p.num_chunks * p.chunk;
  plan.total_chunks = p.num_chunks;
  plan.order = order.data();
  plan.num_items = static_cast<std::int64_t>(order.size());
  plan.row_offset = row_offset.data();
  plan.chunk_offset = p.chunk_offset.data();
  st.chunk_segment.resize(static_cast<std::size_t>(p.num_chunks));
  for (std::int64_t s = 0; s < nseg; ++s)
    for (std::int64_t c = p.chunk_offset[s]; c < (s + 1 < nseg ? p.chunk_offset[s + 1] : p.num_chunks); ++c)
      st.chunk_segment[c] = s;
  plan.chunk_segment = st.chunk_segment.data();
}

Status forward_chunk_count(const ForwardParams& params, std::int64_t* num_chunks) {
  KDA_ROUTE_TO_CUDA(params, forward_chunk_count(params, num_chunks));
  detail::Problem p;
  ForwardParams probe = params;
  probe.chunk_states = TensorView{};  // the count is what sizes it
  // Only the inputs and the sequence description matter: outputs are not validated, and fp64
  // inputs (the oracle's) are accepted.
  KDA_RETURN_IF_ERROR(detail::plan_forward(probe, /*oracle=*/true, &p, /*backward=*/true));
  *num_chunks = p.num_chunks;
  return {};
}

}  // namespace kda

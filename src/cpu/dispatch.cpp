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
  bool bf16_dot_products = false;  // bf16 inputs' state products as vdpbf16ps (choose_bf16_dot_products)
  bool decode_strips = false;      // large K-first decode calls in column strips (choose_decode_strips)
  // KDA_CPU_TARGET names no target this CPU runs, or KDA_BF16_DOT_PRODUCTS or KDA_DECODE_STRIPS
  // no setting it can honour: every kernel call fails with this
  std::string error;
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

// An auto|on|off environment setting: kRule (the caller's vendor rule) for auto or unset; any
// other value sets c.error, naming the variable and the value.
enum class Setting { kRule, kOn, kOff, kInvalid };
Setting read_setting(const char* name, TargetChoice& c) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return Setting::kRule;
  if (std::strcmp(value, "on") == 0) return Setting::kOn;
  if (std::strcmp(value, "off") == 0) return Setting::kOff;
  c.error = std::string("environment variable ") + name + ": expected auto, on or off, got '" + value + "'";
  return Setting::kInvalid;
}

// Whether bf16 inputs take the avx512 target's bf16 pair dot products (vdpbf16ps, fp32
// accumulation; Options::bf16_dot_products permitting) or fp32 FMAs. One vdpbf16ps does 32 pair
// products, twice an fp32 FMA's flops, but only pays where the CPU issues it as fast as its FMAs:
// AMD's Zen 4 does (462 against 233 GFLOP/s measured, docs/PERF.md "former Zen 4 machine"), while
// Intel's Xeons issue it at half the rate of their two 512-bit FMA ports, so there it halves the
// product rate (this project's Emerald Rapids: 163 against 288-344 GFLOP/s, and the bf16 forward
// 1.24-1.27x slower with bf16 products than with fp32 ones; docs/PERF.md, thirtieth session).
// The choice is by vendor, not by a timing at start-up, so that a given CPU always computes the
// same bits. KDA_BF16_DOT_PRODUCTS=on forces them wherever the CPU has AVX512_BF16 (ctest runs
// the suite so on Intel CPUs, whose default would leave those kernels untested), off never uses
// them; auto (or unset) is the vendor rule.
void choose_bf16_dot_products(TargetChoice& c) {
  bool has_bf16 = false, pays = false;
#if defined(KDA_HAVE_X86_TARGETS)
  has_bf16 = c.target == CpuTarget::kAvx512 && __builtin_cpu_supports("avx512bf16");
  pays = __builtin_cpu_is("amd");
#endif
  const Setting setting = read_setting("KDA_BF16_DOT_PRODUCTS", c);
  c.bf16_dot_products = has_bf16 && (setting == Setting::kOn || (setting == Setting::kRule && pays));
  if (setting == Setting::kOn && !has_bf16) {
    c.error = std::string(
                  "environment variable KDA_BF16_DOT_PRODUCTS: 'on' needs AVX512_BF16 and the avx512 "
                  "target (target: ") +
              target_name(c.target) + ")";
  }
}

// Whether one-token decode calls on K-first fp32 pools whose states pass the caches
// (decode_kernels.inc, kKFirstStripMinBytes) run each state in strips of columns
// (decode_k_first_strips) or in passes over whole rows. Both give the same bits; which is faster
// depends on the core: on AMD's Zen 4 strips were ahead from batch 32 (the note at
// kKFirstStripMinBytes), on this project's Emerald Rapids whole rows are (batch 64, 10 alternated
// runs: medians 94% against 88% of the stream beside them, 42.1 against 38.7 GB/s; docs/PERF.md,
// thirty-second session), so strips are AMD's default only.
// KDA_DECODE_STRIPS=on takes strips on any CPU, off never (ctest runs the decode tests with the
// setting the vendor rule does not pick, so both kernels are tested on either vendor).
void choose_decode_strips(TargetChoice& c) {
  bool rule = false;
#if defined(KDA_HAVE_X86_TARGETS)
  rule = __builtin_cpu_is("amd");
#endif
  const Setting setting = read_setting("KDA_DECODE_STRIPS", c);
  c.decode_strips = setting == Setting::kOn || (setting == Setting::kRule && rule);
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
  if (forced == nullptr || *forced == '\0') {
    // nothing forced
  } else if (std::strcmp(forced, "generic") == 0) {
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
  if (c.error.empty()) choose_bf16_dot_products(c);
  if (c.error.empty()) choose_decode_strips(c);
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

bool cpu_bf16_dot_products() {
  return choice().bf16_dot_products;
}

namespace cpu {
bool k_first_decode_strips() {
  return choice().decode_strips;
}
}  // namespace cpu

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

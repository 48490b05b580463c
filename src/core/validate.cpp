// Argument validation and segment planning for the forward (SPEC.md 1.1-1.3).
// Every message names the argument, what was expected and what was given. Nothing is written
// to any output before this has succeeded.
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif
#include <thread>

#include "core/dtype.hpp"
#include "core/problem.hpp"

namespace kda::detail {
namespace {

template <typename... Parts>
Status fail(const Parts&... parts) {
  std::ostringstream os;
  os << "kda: ";
  (os << ... << parts);
  return Status::error(os.str());
}

bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF64;
}

Status check_float(const char* name, const TensorView& t, bool oracle) {
  if (!is_float(t.dtype) || (!oracle && t.dtype == DType::kF64)) {
    return fail("argument '", name, "': expected dtype float32, bfloat16 or float16",
                oracle ? " (or float64 for the oracle)" : "", ", got ", dtype_name(t.dtype));
  }
  return {};
}

Status check_present(const char* name, const TensorView& t) {
  if (!t.defined()) return fail("argument '", name, "' is required but was not given");
  if (t.ndim > kMaxDims) return fail("argument '", name, "': at most ", kMaxDims, " dims, got ", t.ndim);
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return fail("argument '", name, "': negative size in shape ", t.shape_str());
  }
  if (t.data == nullptr && t.numel() > 0) {
    return fail("argument '", name, "': data pointer is null for a non-empty tensor ", t.shape_str());
  }
  return {};
}

// Checks ndim and each size; -1 in `expected` means "any" (and records the size in `out`).
Status check_shape(const char* name, const TensorView& t, std::initializer_list<std::int64_t> expected,
                   const char* dims_desc) {
  KDA_RETURN_IF_ERROR(check_present(name, t));
  std::ostringstream want;
  want << "[";
  int i = 0;
  bool match = t.ndim == static_cast<int>(expected.size());
  for (std::int64_t e : expected) {
    want << (i ? ", " : "") << e;
    if (match && t.shape[i] != e) match = false;
    ++i;
  }
  want << "]";
  if (!match) {
    return fail("argument '", name, "': expected shape ", dims_desc, " = ", want.str(), ", got ", t.shape_str());
  }
  return {};
}

// Outputs must not alias themselves: no zero stride on a dimension of size > 1.
Status check_writable(const char* name, const TensorView& t) {
  if (t.numel() == 0) return {};  // nothing to write (numpy gives empty arrays zero strides)
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] > 1 && t.strides[i] == 0) {
      return fail("argument '", name, "': output has a zero (broadcast) stride on dim ", i, " of shape ", t.shape_str(),
                  "; outputs need distinct elements");
    }
  }
  // Distinct elements: each dim's stride (by size) must step past everything the smaller-stride
  // dims span. Conservative: an interleaving of dims that happens not to collide is refused too.
  std::array<std::pair<std::int64_t, std::int64_t>, kMaxDims> dims{};  // (|stride|, size) of dims of size > 1
  int nd = 0;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1) dims[nd++] = {t.strides[i] < 0 ? -t.strides[i] : t.strides[i], t.shape[i]};
  for (int i = 1; i < nd; ++i)  // insertion sort of at most kMaxDims entries
    for (int j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  std::int64_t span = 1;  // elements covered by the dims so far
  for (int i = 0; i < nd; ++i) {
    if (dims[i].first < span) {
      std::string strides = "[";
      for (int j = 0; j < t.ndim; ++j) strides += (j ? ", " : "") + std::to_string(t.strides[j]);
      return fail("argument '", name, "': output elements overlap in memory (shape ", t.shape_str(), ", strides ",
                  strides, "]); outputs need distinct elements");
    }
    span = dims[i].first * (dims[i].second - 1) + span;
  }
  return {};
}

// lead: the name of the first dim of a 4-D state ("B" fixed length, "N" cu_seqlens).
Status check_state(const char* name, const TensorView& t, const Problem& p, std::int64_t per_row, bool segment_ids,
                   const char* lead, bool kfirst, StateAddressing* addr) {
  const std::int64_t a = kfirst ? p.K : p.V;
  const std::int64_t b = kfirst ? p.V : p.K;
  std::string desc = segment_ids ? "[B, max_num_segments, HV, " : std::string("[") + lead + ", HV, ";
  desc += kfirst ? "K, V]" : "V, K]";
  if (segment_ids) {
    KDA_RETURN_IF_ERROR(check_shape(name, t, {p.B, per_row, p.HV, a, b}, desc.c_str()));
    addr->per_row = per_row;
    addr->stride_row = t.strides[0];
    addr->stride_slot = t.strides[1];
  } else {
    KDA_RETURN_IF_ERROR(check_shape(name, t, {p.num_states, p.HV, a, b}, desc.c_str()));
    addr->per_row = p.num_states > 0 ? p.num_states : 1;
    addr->stride_row = 0;
    addr->stride_slot = t.strides[0];
  }
  const int nd = t.ndim;
  addr->stride_hv = t.strides[nd - 3];
  addr->stride_k = kfirst ? t.strides[nd - 2] : t.strides[nd - 1];
  addr->stride_v = kfirst ? t.strides[nd - 1] : t.strides[nd - 2];
  return {};
}

Status plan_cu_seqlens(const TensorView& cu, Problem* p) {
  KDA_RETURN_IF_ERROR(check_present("cu_seqlens", cu));
  if (cu.ndim != 1 || cu.shape[0] < 1) {
    return fail("argument 'cu_seqlens': expected shape [N + 1] with N >= 0, got ", cu.shape_str());
  }
  if (cu.dtype != DType::kI32 && cu.dtype != DType::kI64) {
    return fail("argument 'cu_seqlens': expected dtype int32 or int64, got ", dtype_name(cu.dtype));
  }
  if (p->B != 1) {
    return fail("argument 'cu_seqlens': packed sequences need batch size B = 1, got B = ", p->B);
  }
  const std::int64_t n = cu.shape[0] - 1;
  if (load_index(cu, 0) != 0) {
    return fail("argument 'cu_seqlens': expected cu_seqlens[0] = 0, got ", load_index(cu, 0));
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t a = load_index(cu, i), b = load_index(cu, i + 1);
    if (b < a) {
      return fail("argument 'cu_seqlens': expected non-decreasing values, got cu_seqlens[", i, "] = ", a,
                  " > cu_seqlens[", i + 1, "] = ", b);
    }
  }
  const std::int64_t end = load_index(cu, n);
  if (end > p->T) {
    return fail("argument 'cu_seqlens': expected the last value <= the total tokens T = ", p->T, ", got ", end);
  }
  // Tokens after the last sequence are padding (FLA's graph mode packs into a fixed-size buffer):
  // output 0, gradients 0, as segment_ids' trailing padding.
  if (end < p->T) p->padding.push_back({0, end, p->T});
  p->num_states = n;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t a = load_index(cu, i), b = load_index(cu, i + 1);
    p->segments.push_back({0, a, b - a, i});
  }
  return {};
}

Status plan_segment_ids(const TensorView& ids, std::int64_t max_segments, Problem* p) {
  KDA_RETURN_IF_ERROR(check_present("segment_ids", ids));
  if (ids.dtype != DType::kI32) {
    return fail("argument 'segment_ids': expected dtype int32, got ", dtype_name(ids.dtype));
  }
  const bool broadcast = ids.ndim == 1;
  if (!((ids.ndim == 1 && ids.shape[0] == p->T) || (ids.ndim == 2 && ids.shape[0] == p->B && ids.shape[1] == p->T))) {
    return fail("argument 'segment_ids': expected shape [T] = [", p->T, "] or [B, T] = [", p->B, ", ", p->T, "], got ",
                ids.shape_str());
  }
  if (max_segments < 1) {
    return fail("argument 'max_num_segments': expected >= 1 with segment_ids, got ", max_segments);
  }
  p->num_states = p->B * max_segments;
  const auto* data = static_cast<const std::int32_t*>(ids.data);
  for (std::int64_t b = 0; b < p->B; ++b) {
    const std::int64_t row_off = broadcast ? 0 : b * ids.strides[0];
    const std::int64_t tstride = ids.strides[ids.ndim - 1];
    std::int64_t expected_next = 1;  // the id the next run must have
    std::int64_t run_start = 0;
    std::int64_t current = -1;  // id of the run in progress
    for (std::int64_t t = 0; t <= p->T; ++t) {
      const std::int64_t id = t < p->T ? data[row_off + t * tstride] : -1;
      if (t < p->T && (id < 0 || id > max_segments)) {
        return fail("argument 'segment_ids': expected ids in [0, max_num_segments = ", max_segments, "], got ", id,
                    " at row ", b, ", token ", t);
      }
      if (id == current) continue;
      if (current > 0) p->segments.push_back({b, run_start, t - run_start, b * max_segments + current - 1});
      // Padding (0) may be anywhere (left-padded rows, gaps), as Tokamax's reference allows.
      if (current == 0) p->padding.push_back({b, run_start, t});
      if (t == p->T) break;
      if (id > 0) {
        if (id != expected_next) {
          return fail(
              "argument 'segment_ids': expected contiguous runs numbered 1, 2, 3, ... in order (padding 0 "
              "anywhere); at row ",
              b, ", token ", t, " expected id ", expected_next, ", got ", id);
        }
        ++expected_next;
      }
      current = id;
      run_start = t;
    }
    // Slots with no tokens: empty segments (final state = initial state or 0).
    for (std::int64_t s = expected_next; s <= max_segments; ++s) {
      p->segments.push_back({b, 0, 0, b * max_segments + s - 1});
    }
  }
  return {};
}

// initial_state as a pool [slots, HV, K, V] read through initial_state_indices [N].
Status plan_initial_slots(const ForwardParams& prm, bool kfirst, bool has_ids, Problem* p) {
  const TensorView& idx = prm.initial_state_indices;
  const TensorView& pool = prm.initial_state;
  KDA_RETURN_IF_ERROR(check_present("initial_state_indices", idx));
  if (has_ids) {
    return fail("argument 'initial_state_indices': not supported with segment_ids (use cu_seqlens or a fixed batch)");
  }
  if (!pool.defined()) {
    return fail("argument 'initial_state_indices': given without initial_state (the state pool)");
  }
  if (idx.dtype != DType::kI32 && idx.dtype != DType::kI64) {
    return fail("argument 'initial_state_indices': expected dtype int32 or int64, got ", dtype_name(idx.dtype));
  }
  if (idx.ndim != 1 || idx.shape[0] != p->num_states) {
    return fail("argument 'initial_state_indices': expected shape [N] = [", p->num_states, "], got ", idx.shape_str());
  }
  KDA_RETURN_IF_ERROR(check_present("initial_state", pool));
  const std::int64_t a = kfirst ? p->K : p->V, b = kfirst ? p->V : p->K;
  if (pool.ndim != 4 || pool.shape[1] != p->HV || pool.shape[2] != a || pool.shape[3] != b) {
    return fail("argument 'initial_state': expected a state pool of shape [slots, HV, ", kfirst ? "K, V" : "V, K",
                "] = [slots, ", p->HV, ", ", a, ", ", b, "], got ", pool.shape_str());
  }
  KDA_RETURN_IF_ERROR(check_float("initial_state", pool, /*oracle=*/true));
  p->init_slot.resize(static_cast<std::size_t>(p->num_states));
  for (std::int64_t n = 0; n < p->num_states; ++n) {
    const std::int64_t s = load_index(idx, n);
    if (s >= pool.shape[0]) {
      return fail("argument 'initial_state_indices': index ", n, " is ", s, ", expected < slots = ", pool.shape[0],
                  " (negative = zero initial state)");
    }
    p->init_slot[n] = s < 0 ? -1 : s;
  }
  StateAddressing& ad = p->init_addr;
  ad.per_row = pool.shape[0] > 0 ? pool.shape[0] : 1;
  ad.stride_row = 0;
  ad.stride_slot = pool.strides[0];
  ad.stride_hv = pool.strides[1];
  ad.stride_k = kfirst ? pool.strides[2] : pool.strides[3];
  ad.stride_v = kfirst ? pool.strides[3] : pool.strides[2];
  return {};
}

}  // namespace

namespace {

// GNU OpenMP's thread pool does not survive fork(): in the child of a process that has run a
// parallel region, the next team of more than one thread waits forever for the parent's workers,
// which the child does not have (measured: a call hung in a child forked after one call in the
// parent; with one thread it returned the parent's results bitwise). So, as PyTorch does, a process
// forked after libkda ran a parallel team computes on one thread. Forks before any call, and
// spawned processes, keep every thread.
std::atomic<bool> g_team_started{false};
std::atomic<bool> g_forked_after_team{false};

#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
void mark_forked_child() {
  if (g_team_started.load()) g_forked_after_team.store(true);
}
[[maybe_unused]] const bool kAtforkRegistered = pthread_atfork(nullptr, nullptr, mark_forked_child) == 0;
#endif

}  // namespace

int resolve_threads(int requested) {
  if (g_forked_after_team.load()) return 1;
#ifdef _OPENMP
  const int n = requested > 0 ? requested : omp_get_max_threads();
#else
  const unsigned hw = std::thread::hardware_concurrency();
  const int n = requested > 0 ? requested : (hw ? static_cast<int>(hw) : 1);
#endif
  if (n > 1) g_team_started.store(true);
  return n;
}

Status plan_forward(const ForwardParams& prm, bool oracle, Problem* problem, bool backward) {
  Problem& p = *problem;
  p = Problem{};
  const Options& opt = prm.options;
  KDA_RETURN_IF_ERROR(check_present("q", prm.q));
  if (prm.q.ndim != 4) return fail("argument 'q': expected 4 dims [B, T, H, K], got shape ", prm.q.shape_str());
  p.B = prm.q.shape[0];
  p.T = prm.q.shape[1];
  p.H = prm.q.shape[2];
  p.K = prm.q.shape[3];
  KDA_RETURN_IF_ERROR(check_present("v", prm.v));
  if (prm.v.ndim != 4) return fail("argument 'v': expected 4 dims [B, T, HV, V], got shape ", prm.v.shape_str());
  p.HV = prm.v.shape[2];
  p.V = prm.v.shape[3];
  if (p.H < 1 || p.K < 1 || p.HV < 1 || p.V < 1) {
    return fail("arguments 'q'/'v': H, K, HV and V must be >= 1, got q ", prm.q.shape_str(), ", v ", prm.v.shape_str());
  }
  if (p.HV % p.H != 0) {
    return fail("argument 'v': expected value heads HV to be a multiple of H = ", p.H, ", got HV = ", p.HV);
  }
  p.group = p.HV / p.H;
  KDA_RETURN_IF_ERROR(check_shape("k", prm.k, {p.B, p.T, p.H, p.K}, "[B, T, H, K]"));
  KDA_RETURN_IF_ERROR(check_shape("v", prm.v, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]"));
  KDA_RETURN_IF_ERROR(check_shape("g", prm.g, {p.B, p.T, p.HV, p.K}, "[B, T, HV, K]"));
  KDA_RETURN_IF_ERROR(check_shape("beta", prm.beta, {p.B, p.T, p.HV}, "[B, T, HV]"));
  KDA_RETURN_IF_ERROR(check_float("q", prm.q, oracle));
  KDA_RETURN_IF_ERROR(check_float("k", prm.k, oracle));
  KDA_RETURN_IF_ERROR(check_float("v", prm.v, oracle));
  KDA_RETURN_IF_ERROR(check_float("g", prm.g, oracle));
  KDA_RETURN_IF_ERROR(check_float("beta", prm.beta, oracle));
  if (!backward) {  // the backward does not write the forward's outputs
    KDA_RETURN_IF_ERROR(check_shape("o", prm.o, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]"));
    KDA_RETURN_IF_ERROR(check_float("o", prm.o, true));
    if (!oracle && prm.o.dtype != prm.q.dtype) {
      return fail("argument 'o': expected the dtype of q (", dtype_name(prm.q.dtype), "), got ",
                  dtype_name(prm.o.dtype));
    }
    KDA_RETURN_IF_ERROR(check_writable("o", prm.o));
  }

  // Options (SPEC.md 1.3).
  if (!oracle && opt.chunk_size != 64 && opt.chunk_size != 32 && opt.chunk_size != 16) {
    return fail("option 'chunk_size': expected 64, 32 or 16, got ", opt.chunk_size);
  }
  if (opt.chunk_size < 1) return fail("option 'chunk_size': expected >= 1, got ", opt.chunk_size);
  p.chunk = opt.chunk_size;
  if (!oracle && opt.path != Path::kFused && opt.path != Path::kStaged) {
    return fail("option 'path': expected fused or staged, got ", static_cast<int>(opt.path));
  }
  if (opt.num_threads < 0) return fail("option 'num_threads': expected >= 0 (0 = all cores), got ", opt.num_threads);
  p.threads = resolve_threads(opt.num_threads);
  if (std::isnan(opt.scale)) {
    p.scale64 = 1.0 / std::sqrt(static_cast<double>(p.K));
  } else if (!std::isfinite(opt.scale) || std::fabs(opt.scale) > std::numeric_limits<float>::max()) {
    // the kernels compute with the scale as a float: it must be finite there too
    return fail("option 'scale': expected a finite value (within float range), got ", opt.scale);
  } else {
    p.scale64 = opt.scale;
  }
  p.scale = static_cast<float>(p.scale64);
  p.l2norm = opt.use_qk_l2norm_in_kernel;
  if (opt.use_gate_in_kernel) {
    if (opt.has_lower_bound) {
      // checked as the kernels' float too: finite there and still < 0 (-1e-50 would round to -0)
      if (!(opt.lower_bound < 0.0) || !std::isfinite(opt.lower_bound) ||
          std::fabs(opt.lower_bound) > std::numeric_limits<float>::max() ||
          !(static_cast<float>(opt.lower_bound) < 0.0f)) {
        return fail("option 'lower_bound': expected a finite value < 0 (within float range), got ", opt.lower_bound);
      }
      p.gate = GateMode::kLowerBoundSigmoid;
      p.lower_bound = static_cast<float>(opt.lower_bound);
      p.lower_bound64 = opt.lower_bound;
    } else {
      p.gate = GateMode::kSoftplus;
      if (!prm.A_log.defined()) {
        return fail(
            "argument 'A_log': required with use_gate_in_kernel and no lower_bound "
            "(g = -exp(A_log) * softplus(g + dt_bias)), but was not given");
      }
    }
    if (prm.A_log.defined()) {
      KDA_RETURN_IF_ERROR(check_shape("A_log", prm.A_log, {p.HV}, "[HV]"));
      KDA_RETURN_IF_ERROR(check_float("A_log", prm.A_log, oracle));
    }
    if (prm.dt_bias.defined()) {
      KDA_RETURN_IF_ERROR(check_present("dt_bias", prm.dt_bias));
      const TensorView& d = prm.dt_bias;
      const bool ok =
          (d.ndim == 1 && d.shape[0] == p.HV * p.K) || (d.ndim == 2 && d.shape[0] == p.HV && d.shape[1] == p.K);
      if (!ok) {
        return fail("argument 'dt_bias': expected shape [HV * K] = [", p.HV * p.K, "] or [HV, K] = [", p.HV, ", ", p.K,
                    "], got ", d.shape_str());
      }
      KDA_RETURN_IF_ERROR(check_float("dt_bias", d, oracle));
    }
  } else {
    if (opt.has_lower_bound) {
      return fail("option 'lower_bound': only meaningful with use_gate_in_kernel=true, got lower_bound = ",
                  opt.lower_bound, " with use_gate_in_kernel=false");
    }
    if (prm.A_log.defined()) {
      return fail(
          "argument 'A_log': only used with use_gate_in_kernel=true, but was given with "
          "use_gate_in_kernel=false");
    }
    if (prm.dt_bias.defined()) {
      return fail(
          "argument 'dt_bias': only used with use_gate_in_kernel=true, but was given with "
          "use_gate_in_kernel=false");
    }
  }
  p.beta_sigmoid = opt.use_beta_sigmoid_in_kernel;
  if (opt.allow_neg_eigval && !opt.use_beta_sigmoid_in_kernel) {
    return fail(
        "option 'allow_neg_eigval': requires use_beta_sigmoid_in_kernel=true "
        "(beta = 2 * sigmoid(beta_raw)), got use_beta_sigmoid_in_kernel=false");
  }
  p.beta_scale = opt.allow_neg_eigval ? 2.0f : 1.0f;

  // Sequences (SPEC.md 1.2).
  const bool has_cu = prm.cu_seqlens.defined();
  const bool has_ids = prm.segment_ids.defined();
  if (has_cu && has_ids) {
    return fail("arguments 'cu_seqlens' and 'segment_ids': give at most one sequence description, got both");
  }
  if (!has_ids && prm.max_num_segments != 0) {
    return fail("argument 'max_num_segments': only used with segment_ids, got ", prm.max_num_segments);
  }
  if (has_cu) {
    KDA_RETURN_IF_ERROR(plan_cu_seqlens(prm.cu_seqlens, &p));
  } else if (has_ids) {
    KDA_RETURN_IF_ERROR(plan_segment_ids(prm.segment_ids, prm.max_num_segments, &p));
  } else {
    p.num_states = p.B;
    for (std::int64_t b = 0; b < p.B; ++b) p.segments.push_back({b, 0, p.T, b});
  }

  const bool kfirst = opt.state_layout == StateLayout::kKFirst;
  const std::int64_t per_row = has_ids ? prm.max_num_segments : p.num_states;
  const char* lead = has_cu ? "N" : "B";
  if (prm.initial_state_indices.defined()) {
    KDA_RETURN_IF_ERROR(plan_initial_slots(prm, kfirst, has_ids, &p));
  } else if (prm.initial_state.defined()) {
    KDA_RETURN_IF_ERROR(
        check_state("initial_state", prm.initial_state, p, per_row, has_ids, lead, kfirst, &p.init_addr));
    // Any float dtype, fp64 included: states are read into fp32 (fp64 in the oracle).
    KDA_RETURN_IF_ERROR(check_float("initial_state", prm.initial_state, /*oracle=*/true));
  }
  p.chunk_offset.resize(p.segments.size());
  for (std::size_t s = 0; s < p.segments.size(); ++s) {
    p.chunk_offset[s] = p.num_chunks;
    p.num_chunks += (p.segments[s].length + p.chunk - 1) / p.chunk;
  }
  if (prm.chunk_states.defined()) {
    KDA_RETURN_IF_ERROR(check_shape("chunk_states", prm.chunk_states,
                                    {p.num_chunks, p.HV, kfirst ? p.K : p.V, kfirst ? p.V : p.K},
                                    kfirst ? "[NC, HV, K, V]" : "[NC, HV, V, K]"));
    if (prm.chunk_states.dtype != DType::kF32 && !(oracle && prm.chunk_states.dtype == DType::kF64)) {
      return fail("argument 'chunk_states': expected dtype float32", oracle ? " (or float64 for the oracle)" : "",
                  ", got ", dtype_name(prm.chunk_states.dtype));
    }
    if (!backward) KDA_RETURN_IF_ERROR(check_writable("chunk_states", prm.chunk_states));
    const TensorView& t = prm.chunk_states;
    p.chunk_addr.per_row = p.num_chunks > 0 ? p.num_chunks : 1;
    p.chunk_addr.stride_slot = t.strides[0];
    p.chunk_addr.stride_hv = t.strides[1];
    p.chunk_addr.stride_k = kfirst ? t.strides[2] : t.strides[3];
    p.chunk_addr.stride_v = kfirst ? t.strides[3] : t.strides[2];
  }
  if (prm.v_new.defined()) {
    KDA_RETURN_IF_ERROR(check_shape("v_new", prm.v_new, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]"));
    if (prm.v_new.dtype != DType::kF32 && !(oracle && prm.v_new.dtype == DType::kF64)) {
      return fail("argument 'v_new': expected dtype float32", oracle ? " (or float64 for the oracle)" : "", ", got ",
                  dtype_name(prm.v_new.dtype));
    }
    if (!backward) KDA_RETURN_IF_ERROR(check_writable("v_new", prm.v_new));
  }
  if (prm.final_state.defined() && !backward) {
    KDA_RETURN_IF_ERROR(check_state("final_state", prm.final_state, p, per_row, has_ids, lead, kfirst, &p.final_addr));
    if (prm.final_state.dtype != DType::kF32 && !(oracle && prm.final_state.dtype == DType::kF64)) {
      return fail("argument 'final_state': expected dtype float32", oracle ? " (or float64 for the oracle)" : "",
                  ", got ", dtype_name(prm.final_state.dtype));
    }
    KDA_RETURN_IF_ERROR(check_writable("final_state", prm.final_state));
  }
  return {};
}

Status plan_backward(const BackwardParams& prm, bool oracle, Problem* problem) {
  KDA_RETURN_IF_ERROR(plan_forward(prm.forward, oracle, problem, /*backward=*/true));
  const Problem& p = *problem;
  const ForwardParams& f = prm.forward;
  const bool kfirst = f.options.state_layout == StateLayout::kKFirst;
  const bool has_ids = f.segment_ids.defined();
  const std::int64_t per_row = has_ids ? f.max_num_segments : p.num_states;
  const char* lead = f.cu_seqlens.defined() ? "N" : "B";
  KDA_RETURN_IF_ERROR(check_shape("d_o", prm.d_o, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]"));
  KDA_RETURN_IF_ERROR(check_float("d_o", prm.d_o, /*oracle=*/true));  // any float dtype, fp64 too
  StateAddressing unused;
  if (prm.d_final_state.defined()) {
    KDA_RETURN_IF_ERROR(check_state("d_final_state", prm.d_final_state, p, per_row, has_ids, lead, kfirst, &unused));
    KDA_RETURN_IF_ERROR(check_float("d_final_state", prm.d_final_state, /*oracle=*/true));
  }
  struct Grad {
    const char* name;
    const TensorView& t;
    std::initializer_list<std::int64_t> shape;
    const char* desc;
  };
  const Grad grads[] = {
      {"dq", prm.dq, {p.B, p.T, p.H, p.K}, "[B, T, H, K]"},   {"dk", prm.dk, {p.B, p.T, p.H, p.K}, "[B, T, H, K]"},
      {"dv", prm.dv, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]"}, {"dg", prm.dg, {p.B, p.T, p.HV, p.K}, "[B, T, HV, K]"},
      {"dbeta", prm.dbeta, {p.B, p.T, p.HV}, "[B, T, HV]"},
  };
  for (const Grad& g : grads) {
    if (!g.t.defined()) continue;
    KDA_RETURN_IF_ERROR(check_shape(g.name, g.t, g.shape, g.desc));
    KDA_RETURN_IF_ERROR(check_float(g.name, g.t, oracle));
    KDA_RETURN_IF_ERROR(check_writable(g.name, g.t));
  }
  auto check_f32 = [&](const char* name, const TensorView& t) -> Status {
    if (t.dtype != DType::kF32 && !(oracle && t.dtype == DType::kF64)) {
      return fail("argument '", name, "': expected dtype float32", oracle ? " (or float64 for the oracle)" : "",
                  ", got ", dtype_name(t.dtype));
    }
    return check_writable(name, t);
  };
  if (prm.dh0.defined()) {
    KDA_RETURN_IF_ERROR(check_state("dh0", prm.dh0, p, per_row, has_ids, lead, kfirst, &problem->dh0_addr));
    KDA_RETURN_IF_ERROR(check_f32("dh0", prm.dh0));
  }
  if (prm.dA_log.defined()) {
    if (!f.A_log.defined()) return fail("argument 'dA_log': given, but the forward has no A_log");
    KDA_RETURN_IF_ERROR(check_shape("dA_log", prm.dA_log, {p.HV}, "[HV]"));
    KDA_RETURN_IF_ERROR(check_f32("dA_log", prm.dA_log));
  }
  if (prm.ddt_bias.defined()) {
    if (!f.dt_bias.defined()) return fail("argument 'ddt_bias': given, but the forward has no dt_bias");
    KDA_RETURN_IF_ERROR(check_present("ddt_bias", prm.ddt_bias));
    const TensorView& d = prm.ddt_bias;
    if (d.ndim != f.dt_bias.ndim || d.numel() != p.HV * p.K || (d.ndim == 2 && d.shape[1] != p.K)) {
      return fail("argument 'ddt_bias': expected the shape of dt_bias ", f.dt_bias.shape_str(), ", got ",
                  d.shape_str());
    }
    KDA_RETURN_IF_ERROR(check_f32("ddt_bias", d));
  }
  return {};
}

Status plan_decode(const DecodeParams& prm, Problem* problem) {
  // Inputs and options as a fixed-length forward of N rows of T tokens.
  ForwardParams f;
  f.q = prm.q, f.k = prm.k, f.v = prm.v, f.g = prm.g, f.beta = prm.beta;
  f.A_log = prm.A_log, f.dt_bias = prm.dt_bias, f.o = prm.o;
  f.options = prm.options;
  f.options.chunk_size = 64;
  f.options.path = Path::kFused;
  KDA_RETURN_IF_ERROR(plan_forward(f, /*oracle=*/false, problem));
  Problem& p = *problem;
  const bool kfirst = prm.options.state_layout == StateLayout::kKFirst;
  const TensorView& pool = prm.state_pool;
  KDA_RETURN_IF_ERROR(check_present("state_pool", pool));
  const std::int64_t a = kfirst ? p.K : p.V, b = kfirst ? p.V : p.K;
  if (pool.ndim != 4 || pool.shape[1] != p.HV || pool.shape[2] != a || pool.shape[3] != b) {
    return fail("argument 'state_pool': expected shape [slots, HV, ", kfirst ? "K, V" : "V, K", "] = [slots, ", p.HV,
                ", ", a, ", ", b, "], got ", pool.shape_str());
  }
  // Computed in fp32 whatever the pool holds; a bf16 or fp16 pool is read converted and written
  // rounded (as FLA's and vLLM's decode kernels store their pools), at some cost in accuracy.
  if (pool.dtype != DType::kF32 && pool.dtype != DType::kBF16 && pool.dtype != DType::kF16)
    return fail("argument 'state_pool': expected dtype float32, bfloat16 or float16, got ", dtype_name(pool.dtype));
  KDA_RETURN_IF_ERROR(check_writable("state_pool", pool));
  const std::int64_t slots = pool.shape[0];
  const TensorView& idx = prm.slot_indices;
  KDA_RETURN_IF_ERROR(check_present("slot_indices", idx));
  if (idx.dtype != DType::kI32 && idx.dtype != DType::kI64) {
    return fail("argument 'slot_indices': expected dtype int32 or int64, got ", dtype_name(idx.dtype));
  }
  const bool per_token = idx.ndim == 2;
  // [N, T'] with T' > T: the first T columns are used, as FLA's and vLLM's kernels read each row
  // of the index tensor through its stride (vLLM keeps [N, num_spec + 1] of capacity). Every
  // column is range-checked; only the used ones read or write.
  if (!((idx.ndim == 1 && idx.shape[0] == p.B) || (idx.ndim == 2 && idx.shape[0] == p.B && idx.shape[1] >= p.T))) {
    return fail("argument 'slot_indices': expected shape [N] = [", p.B, "] or [N, T'] = [", p.B, ", >= ", p.T,
                "] (T = ", p.T, " tokens), got ", idx.shape_str());
  }
  const std::int64_t idx_columns = per_token ? idx.shape[1] : 1;
  auto index_at = [&](std::int64_t n, std::int64_t t) -> std::int64_t {
    const std::int64_t off = n * idx.strides[0] + (per_token ? t * idx.strides[1] : 0);
    return idx.dtype == DType::kI64 ? static_cast<const std::int64_t*>(idx.data)[off]
                                    : static_cast<const std::int32_t*>(idx.data)[off];
  };
  const TensorView& acc = prm.num_accepted_tokens;
  if (acc.defined()) {
    KDA_RETURN_IF_ERROR(check_present("num_accepted_tokens", acc));
    if (!per_token)
      return fail("argument 'num_accepted_tokens': needs slot_indices of shape [N, T], got ", idx.shape_str());
    if (acc.dtype != DType::kI32 && acc.dtype != DType::kI64) {
      return fail("argument 'num_accepted_tokens': expected dtype int32 or int64, got ", dtype_name(acc.dtype));
    }
    if (acc.ndim != 1 || acc.shape[0] != p.B) {
      return fail("argument 'num_accepted_tokens': expected shape [N] = [", p.B, "], got ", acc.shape_str());
    }
  }
  p.decode_read.assign(static_cast<std::size_t>(p.B), -1);
  p.decode_write.assign(static_cast<std::size_t>(p.B * p.T), -1);
  std::vector<std::int64_t> writer(static_cast<std::size_t>(slots), -1);
  for (std::int64_t n = 0; n < p.B; ++n) {
    std::int64_t first = 0;
    if (acc.defined()) {
      const std::int64_t a_n = load_index(acc, n);
      if (a_n < 1 || a_n > p.T) {
        return fail("argument 'num_accepted_tokens': expected values in [1, T = ", p.T, "], got ", a_n, " at row ", n);
      }
      first = a_n - 1;
    }
    for (std::int64_t t = 0; t < idx_columns; ++t) {
      const std::int64_t s = index_at(n, t);
      if (s >= slots) {
        return fail("argument 'slot_indices': expected indices < slots = ", slots, " (negative = padding), got ", s,
                    " at row ", n, per_token ? ", token " + std::to_string(t) : std::string());
      }
    }
    // No tokens (T = 0): nothing read, nothing written, as for a padding row ([N, 0] indices
    // have no entry to read).
    const std::int64_t read = p.T == 0 ? -1 : index_at(n, first);
    if (read < 0) continue;  // padding row: nothing read, nothing written
    p.decode_read[n] = read;
    for (std::int64_t t = 0; t < p.T; ++t) {
      std::int64_t s = -1;
      if (per_token)
        s = index_at(n, t);
      else if (t == p.T - 1)
        s = read;
      if (s < 0) continue;
      if (writer[s] >= 0 && writer[s] != n) {
        return fail("argument 'slot_indices': slot ", s, " is written by rows ", writer[s], " and ", n,
                    "; each slot may belong to one sequence");
      }
      writer[s] = n;
      p.decode_write[n * p.T + t] = s;
    }
  }
  StateAddressing& ad = p.init_addr;
  ad.per_row = slots > 0 ? slots : 1;
  ad.stride_slot = pool.strides[0];
  ad.stride_hv = pool.strides[1];
  ad.stride_k = kfirst ? pool.strides[2] : pool.strides[3];
  ad.stride_v = kfirst ? pool.strides[3] : pool.strides[2];
  return {};
}

}  // namespace kda::detail

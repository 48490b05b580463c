// XLA FFI handlers (CPU) of the libkda forward and backward, for the JAX integration
// (python/libkda/jax.py, Tokamax's kimi_delta_attention contract). Built only when the XLA FFI
// headers are found (jaxlib ships them: jax.ffi.include_dir(); see python/CMakeLists.txt).
//
// Layouts (Tokamax, head-first; XLA hands us dense row-major buffers):
//   query, key [H, B, T, K]; value [HV, B, T, V]; gate [HV, B, T, K]; beta [HV, B, T];
//   a_log [HV]; delta_time_bias [HV * K]; segment_ids [B, T] int32;
//   initial_state / final_state [B, N, HV, K, V] (N = 1 without segment_ids); output [HV, B, T, V].
// Each head-first buffer is described to the library as the batch-first view it expects
// ([B, T, H, K] etc., SPEC.md 1.1) purely through strides: nothing is transposed or copied.
//
// Every buffer may carry extra leading dims (the same number on all): that is how jax.vmap reaches
// us (ffi_call vmap_method="expand_dims": mapped operands carry the mapped axes in front, unmapped
// ones size-1 dims there, which broadcast here without a copy). The handler loops over the
// leading index, one library call per index, each on strided views of the buffers.
//
// Optional operands and results are passed as "remaining" args / rets; the `present` attribute
// says which are there (bits below, mirrored by python/libkda/jax.py).
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kda/kda.hpp"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// `present` bits.
constexpr std::int64_t kHasALog = 1;
constexpr std::int64_t kHasDtBias = 2;
constexpr std::int64_t kHasSegmentIds = 4;
constexpr std::int64_t kHasInitialState = 8;
constexpr std::int64_t kHasChunkStates = 16;   // forward: result; backward: operand
constexpr std::int64_t kHasDFinalState = 32;   // backward operand
constexpr std::int64_t kWantDh0 = 64;          // backward result
constexpr std::int64_t kWantDALog = 128;       // backward result
constexpr std::int64_t kWantDdtBias = 256;     // backward result
constexpr std::int64_t kWantFinalState = 512;  // forward result
constexpr std::int64_t kHasVNew = 1024;        // forward: result; backward: operand (the token deltas)

// `flags` bits (the same as the raw bindings, python/src/raw.cpp).
constexpr std::int64_t kL2Norm = 1;
constexpr std::int64_t kGateInKernel = 2;
constexpr std::int64_t kBetaSigmoid = 4;
constexpr std::int64_t kAllowNegEigval = 8;
constexpr std::int64_t kFp32Products = 32;  // Options::bf16_dot_products = false

ffi::Error invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("kda (jax ffi): " + msg);
}

bool to_kda_dtype(ffi::DataType t, kda::DType* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = kda::DType::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = kda::DType::kBF16;
      return true;
    case ffi::DataType::F16:
      *out = kda::DType::kF16;
      return true;
    case ffi::DataType::F64:
      *out = kda::DType::kF64;
      return true;
    case ffi::DataType::S32:
      *out = kda::DType::kI32;
      return true;
    case ffi::DataType::S64:
      *out = kda::DType::kI64;
      return true;
    default:
      return false;
  }
}

// One dense row-major XLA buffer: leading (vmap) dims, then the `core` dims of the operand.
struct Dense {
  const XLA_FFI_Buffer* buf = nullptr;
  kda::DType dtype = kda::DType::kF32;
  int rank = 0;
  std::int64_t dims[kda::kMaxDims + 4] = {};
  std::int64_t strides[kda::kMaxDims + 4] = {};  // elements, row-major
  std::size_t itemsize = 4;

  bool defined() const { return buf != nullptr; }
};

// The leading (vmap) dims of a call: n dims of sizes dims[] (the broadcast of the operands', each
// of which has the full size or 1 there), count = their product.
struct Lead {
  int n = 0;
  std::int64_t dims[4] = {};
  std::int64_t count = 1;
};

// Core dim i (0-based after the leading dims).
std::int64_t core_dim(const Dense& d, const Lead& L, int i) {
  return d.dims[L.n + i];
}
std::int64_t core_stride(const Dense& d, const Lead& L, int i) {
  return d.strides[L.n + i];
}
// The start of leading index li (row-major over L.dims); a leading dim of size 1 broadcasts.
char* base(const Dense& d, const Lead& L, std::int64_t li) {
  std::int64_t offset = 0;
  for (int i = L.n - 1; i >= 0; --i) {
    const std::int64_t idx = li % L.dims[i];
    li /= L.dims[i];
    if (d.dims[i] != 1) offset += idx * d.strides[i];
  }
  return static_cast<char*>(d.buf->data) + static_cast<std::size_t>(offset) * d.itemsize;
}

ffi::Error make_dense(const XLA_FFI_Buffer* b, const char* name, int core, Dense* d) {
  d->buf = b;
  if (!to_kda_dtype(ffi::DataType(b->dtype), &d->dtype))
    return invalid(std::string("argument '") + name + "': unsupported dtype");
  d->rank = static_cast<int>(b->rank);
  if (d->rank < core || d->rank > kda::kMaxDims + 4) {
    return invalid(std::string("argument '") + name + "': expected rank " + std::to_string(core) +
                   " (plus leading vmap dims), got " + std::to_string(d->rank));
  }
  std::int64_t s = 1;
  for (int i = d->rank - 1; i >= 0; --i) {
    d->dims[i] = b->dims[i];
    d->strides[i] = s;
    s *= b->dims[i];
  }
  d->itemsize = kda::dtype_size(d->dtype);
  return ffi::Error::Success();
}

// A TensorView of dense buffer d at leading index li: view dim j = core dim perm[j].
kda::TensorView view(const Dense& d, const Lead& L, std::int64_t li, std::initializer_list<int> perm) {
  kda::TensorView t;
  if (!d.defined()) return t;
  t.data = base(d, L, li);
  t.dtype = d.dtype;
  t.ndim = static_cast<int>(perm.size());
  int j = 0;
  for (int c : perm) {
    t.shape[j] = core_dim(d, L, c);
    t.strides[j] = core_stride(d, L, c);
    ++j;
  }
  return t;
}

// Head-first [H, B, T, X] as batch-first [B, T, H, X]; [H, B, T] as [B, T, H].
kda::TensorView head_first4(const Dense& d, const Lead& L, std::int64_t li) {
  return view(d, L, li, {1, 2, 0, 3});
}
kda::TensorView head_first3(const Dense& d, const Lead& L, std::int64_t li) {
  return view(d, L, li, {1, 2, 0});
}
// States [B, N, HV, K, V]: as-is with segment_ids, [B, HV, K, V] (N == 1 dropped) without.
kda::TensorView state_view(const Dense& d, const Lead& L, std::int64_t li, bool segmented) {
  if (segmented) return view(d, L, li, {0, 1, 2, 3, 4});
  return view(d, L, li, {0, 2, 3, 4});
}
kda::TensorView plain(const Dense& d, const Lead& L, std::int64_t li, int core) {
  switch (core) {
    case 1:
      return view(d, L, li, {0});
    case 2:
      return view(d, L, li, {0, 1});
    case 4:
      return view(d, L, li, {0, 1, 2, 3});
    default:
      return view(d, L, li, {0, 1, 2, 3, 4});
  }
}

kda::Options options_of(double scale, double lower_bound, std::int64_t flags, std::int64_t chunk_size) {
  kda::Options opt;
  opt.scale = scale;
  opt.use_qk_l2norm_in_kernel = (flags & kL2Norm) != 0;
  opt.use_gate_in_kernel = (flags & kGateInKernel) != 0;
  opt.has_lower_bound = !std::isnan(lower_bound);
  opt.lower_bound = opt.has_lower_bound ? lower_bound : 0.0;
  opt.use_beta_sigmoid_in_kernel = (flags & kBetaSigmoid) != 0;
  opt.allow_neg_eigval = (flags & kAllowNegEigval) != 0;
  opt.chunk_size = static_cast<int>(chunk_size);
  opt.state_layout = kda::StateLayout::kKFirst;
  opt.bf16_dot_products = (flags & kFp32Products) == 0;
  return opt;
}

// A buffer with the rank of its core (the dims after the leading vmap dims).
using Ranked = std::pair<const Dense*, int>;

// The forward's operands: q, k, v, g, beta and the present optional ones.
struct ForwardOperands {
  Dense q, k, v, g, beta, a_log, dt_bias, segment_ids, initial_state;
  std::vector<Ranked> ranked() const {
    return {{&q, 4},       {&k, 4},           {&v, 4},
            {&g, 4},       {&beta, 3},        {&a_log, 1},
            {&dt_bias, 1}, {&segment_ids, 2}, {&initial_state, 5}};
  }
};

}  // namespace

// AnyBuffer does not expose its XLA_FFI_Buffer; a small shim with the same fields does.
namespace {

struct BufferShim {
  XLA_FFI_Buffer raw;
};

ffi::Error dense_from(const ffi::AnyBuffer& b, const char* name, int core, Dense* d, BufferShim* shim) {
  shim->raw.struct_size = sizeof(XLA_FFI_Buffer);
  shim->raw.extension_start = nullptr;
  shim->raw.dtype = static_cast<XLA_FFI_DataType>(b.element_type());
  shim->raw.data = b.untyped_data();
  const auto dims = b.dimensions();
  shim->raw.rank = static_cast<int64_t>(dims.size());
  shim->raw.dims = const_cast<int64_t*>(dims.begin());
  return make_dense(&shim->raw, name, core, d);
}

template <typename Remaining, typename Get>
ffi::Error take(const Remaining& r, std::size_t* idx, const char* name, int core, Dense* d, BufferShim* shim, Get get) {
  auto b = get(r, *idx);
  if (!b.has_value()) return invalid(std::string("missing buffer '") + name + "'");
  ++*idx;
  return dense_from(*b, name, core, d, shim);
}

auto get_arg = [](const ffi::RemainingArgs& r, std::size_t i) -> std::optional<ffi::AnyBuffer> {
  auto b = r.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) return std::nullopt;
  return *b;
};
auto get_ret = [](const ffi::RemainingRets& r, std::size_t i) -> std::optional<ffi::AnyBuffer> {
  auto b = r.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) return std::nullopt;
  return **b;
};

#define KDA_FFI_TRY(expr)        \
  do {                           \
    ffi::Error _e = (expr);      \
    if (_e.failure()) return _e; \
  } while (0)

struct Shims {
  BufferShim s[32];
  int n = 0;
  BufferShim* next() { return &s[n++]; }
};

ffi::Error read_forward_operands(const ffi::RemainingArgs& args, std::size_t* idx, std::int64_t present,
                                 ForwardOperands* f, Shims* shims) {
  KDA_FFI_TRY(take(args, idx, "query", 4, &f->q, shims->next(), get_arg));
  KDA_FFI_TRY(take(args, idx, "key", 4, &f->k, shims->next(), get_arg));
  KDA_FFI_TRY(take(args, idx, "value", 4, &f->v, shims->next(), get_arg));
  KDA_FFI_TRY(take(args, idx, "gate", 4, &f->g, shims->next(), get_arg));
  KDA_FFI_TRY(take(args, idx, "beta", 3, &f->beta, shims->next(), get_arg));
  if (present & kHasALog) KDA_FFI_TRY(take(args, idx, "a_log", 1, &f->a_log, shims->next(), get_arg));
  if (present & kHasDtBias) KDA_FFI_TRY(take(args, idx, "delta_time_bias", 1, &f->dt_bias, shims->next(), get_arg));
  if (present & kHasSegmentIds) KDA_FFI_TRY(take(args, idx, "segment_ids", 2, &f->segment_ids, shims->next(), get_arg));
  if (present & kHasInitialState) {
    KDA_FFI_TRY(take(args, idx, "initial_state", 5, &f->initial_state, shims->next(), get_arg));
  }
  return ffi::Error::Success();
}

// The leading (vmap) dims of the call: the same number on every buffer; per dim, operands have
// the full size or 1 (broadcast: ffi_call vmap_method="expand_dims" leaves unmapped operands
// at size 1, so they are never copied); results must have the full size.
ffi::Error leading(const std::vector<Ranked>& operands, std::initializer_list<Ranked> results, Lead* L) {
  int n = -1;
  std::vector<Ranked> all = operands;
  all.insert(all.end(), results.begin(), results.end());
  for (const auto& [d, core] : all) {
    if (!d->defined()) continue;
    const int l = d->rank - core;
    if (n < 0) {
      n = l;
      if (n > 4) return invalid("at most 4 leading (vmap) dims");
      for (int i = 0; i < n; ++i) L->dims[i] = 1;
    } else if (l != n) {
      return invalid("operands disagree on the number of leading (vmap) dims");
    }
    for (int i = 0; i < n; ++i) {
      if (d->dims[i] == 1) continue;
      if (L->dims[i] != 1 && L->dims[i] != d->dims[i]) return invalid("operands disagree on the leading (vmap) dims");
      L->dims[i] = d->dims[i];
    }
  }
  L->n = n < 0 ? 0 : n;
  L->count = 1;
  for (int i = 0; i < L->n; ++i) L->count *= L->dims[i];
  for (const auto& [d, core] : results) {
    if (!d->defined()) continue;
    for (int i = 0; i < L->n; ++i) {
      if (d->dims[i] != L->dims[i]) return invalid("a result does not have the full leading (vmap) dims");
    }
  }
  return ffi::Error::Success();
}

kda::ForwardParams forward_params(const ForwardOperands& f, const Lead& L, std::int64_t li,
                                  std::int64_t max_num_segments, const kda::Options& opt) {
  const bool seg = f.segment_ids.defined();
  kda::ForwardParams p;
  p.q = head_first4(f.q, L, li);
  p.k = head_first4(f.k, L, li);
  p.v = head_first4(f.v, L, li);
  p.g = head_first4(f.g, L, li);
  p.beta = head_first3(f.beta, L, li);
  p.A_log = plain(f.a_log, L, li, 1);
  p.dt_bias = plain(f.dt_bias, L, li, 1);
  p.segment_ids = plain(f.segment_ids, L, li, 2);
  p.max_num_segments = seg ? max_num_segments : 0;
  p.initial_state = state_view(f.initial_state, L, li, seg);
  p.options = opt;
  return p;
}

// Trims a chunk_states capacity view to the exact NC of these params.
kda::Status trim_chunk_states(kda::ForwardParams* p) {
  if (!p->chunk_states.defined()) return {};
  kda::ForwardParams counting = *p;
  counting.chunk_states = kda::TensorView();
  counting.final_state = kda::TensorView();
  counting.o = kda::TensorView();
  std::int64_t nc = 0;
  kda::Status st = kda::forward_chunk_count(counting, &nc);
  if (!st.ok()) return st;
  if (p->chunk_states.shape[0] > nc) p->chunk_states.shape[0] = nc;
  return {};
}

ffi::Error KdaForwardImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, double scale, double lower_bound,
                          std::int64_t flags, std::int64_t chunk_size, std::int64_t max_num_segments,
                          std::int64_t present, std::int64_t oracle) {
  Shims shims;
  ForwardOperands f;
  std::size_t ai = 0;
  KDA_FFI_TRY(read_forward_operands(args, &ai, present, &f, &shims));
  std::size_t ri = 0;
  Dense o, final_state, chunk_states, v_new;
  KDA_FFI_TRY(take(rets, &ri, "output", 4, &o, shims.next(), get_ret));
  if (present & kWantFinalState) KDA_FFI_TRY(take(rets, &ri, "final_state", 5, &final_state, shims.next(), get_ret));
  if (present & kHasChunkStates) KDA_FFI_TRY(take(rets, &ri, "chunk_states", 4, &chunk_states, shims.next(), get_ret));
  if (present & kHasVNew) KDA_FFI_TRY(take(rets, &ri, "v_new", 4, &v_new, shims.next(), get_ret));

  Lead L;
  KDA_FFI_TRY(leading(f.ranked(), {{&o, 4}, {&final_state, 5}, {&chunk_states, 4}, {&v_new, 4}}, &L));
  const kda::Options opt = options_of(scale, lower_bound, flags, chunk_size);
  const bool seg = f.segment_ids.defined();
  for (std::int64_t li = 0; li < L.count; ++li) {
    kda::ForwardParams p = forward_params(f, L, li, max_num_segments, opt);
    p.o = head_first4(o, L, li);
    p.final_state = state_view(final_state, L, li, seg);
    p.chunk_states = plain(chunk_states, L, li, 4);
    p.v_new = head_first4(v_new, L, li);  // [HV, B, T, V] like the output
    kda::Status st;
    if (oracle) {
      p.chunk_states = kda::TensorView();
      st = kda::reference_forward(p);
    } else {
      st = trim_chunk_states(&p);
      if (st.ok()) st = kda::chunk_forward(p);
    }
    if (!st.ok()) return invalid(st.message());
  }
  return ffi::Error::Success();
}

ffi::Error KdaBackwardImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, double scale, double lower_bound,
                           std::int64_t flags, std::int64_t chunk_size, std::int64_t max_num_segments,
                           std::int64_t present, std::int64_t oracle) {
  Shims shims;
  ForwardOperands f;
  std::size_t ai = 0;
  KDA_FFI_TRY(read_forward_operands(args, &ai, present, &f, &shims));
  Dense chunk_states, v_new, d_o, d_final_state;
  if (present & kHasChunkStates) KDA_FFI_TRY(take(args, &ai, "chunk_states", 4, &chunk_states, shims.next(), get_arg));
  if (present & kHasVNew) KDA_FFI_TRY(take(args, &ai, "v_new", 4, &v_new, shims.next(), get_arg));
  KDA_FFI_TRY(take(args, &ai, "d_output", 4, &d_o, shims.next(), get_arg));
  if (present & kHasDFinalState)
    KDA_FFI_TRY(take(args, &ai, "d_final_state", 5, &d_final_state, shims.next(), get_arg));

  std::size_t ri = 0;
  Dense dq, dk, dv, dg, dbeta, dh0, da_log, ddt_bias;
  KDA_FFI_TRY(take(rets, &ri, "d_query", 4, &dq, shims.next(), get_ret));
  KDA_FFI_TRY(take(rets, &ri, "d_key", 4, &dk, shims.next(), get_ret));
  KDA_FFI_TRY(take(rets, &ri, "d_value", 4, &dv, shims.next(), get_ret));
  KDA_FFI_TRY(take(rets, &ri, "d_gate", 4, &dg, shims.next(), get_ret));
  KDA_FFI_TRY(take(rets, &ri, "d_beta", 3, &dbeta, shims.next(), get_ret));
  if (present & kWantDh0) KDA_FFI_TRY(take(rets, &ri, "d_initial_state", 5, &dh0, shims.next(), get_ret));
  if (present & kWantDALog) KDA_FFI_TRY(take(rets, &ri, "d_a_log", 1, &da_log, shims.next(), get_ret));
  if (present & kWantDdtBias) KDA_FFI_TRY(take(rets, &ri, "d_delta_time_bias", 1, &ddt_bias, shims.next(), get_ret));

  Lead L;
  std::vector<Ranked> operands = f.ranked();
  operands.insert(operands.end(), {{&chunk_states, 4}, {&v_new, 4}, {&d_o, 4}, {&d_final_state, 5}});
  KDA_FFI_TRY(leading(
      operands, {{&dq, 4}, {&dk, 4}, {&dv, 4}, {&dg, 4}, {&dbeta, 3}, {&dh0, 5}, {&da_log, 1}, {&ddt_bias, 1}}, &L));
  const kda::Options opt = options_of(scale, lower_bound, flags, chunk_size);
  const bool seg = f.segment_ids.defined();
  for (std::int64_t li = 0; li < L.count; ++li) {
    kda::BackwardParams p;
    p.forward = forward_params(f, L, li, max_num_segments, opt);
    p.forward.chunk_states = plain(chunk_states, L, li, 4);
    p.forward.v_new = head_first4(v_new, L, li);
    p.d_o = head_first4(d_o, L, li);
    p.d_final_state = state_view(d_final_state, L, li, seg);
    p.dq = head_first4(dq, L, li);
    p.dk = head_first4(dk, L, li);
    p.dv = head_first4(dv, L, li);
    p.dg = head_first4(dg, L, li);
    p.dbeta = head_first3(dbeta, L, li);
    p.dh0 = state_view(dh0, L, li, seg);
    p.dA_log = plain(da_log, L, li, 1);
    p.ddt_bias = plain(ddt_bias, L, li, 1);
    kda::Status st;
    if (oracle) {
      p.forward.chunk_states = kda::TensorView();
      p.forward.v_new = kda::TensorView();
      st = kda::reference_backward(p);
    } else {
      st = trim_chunk_states(&p.forward);
      if (st.ok()) st = kda::chunk_backward(p);
    }
    if (!st.ok()) return invalid(st.message());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdaJaxForward, KdaForwardImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<double>("scale")
                                  .Attr<double>("lower_bound")
                                  .Attr<std::int64_t>("flags")
                                  .Attr<std::int64_t>("chunk_size")
                                  .Attr<std::int64_t>("max_num_segments")
                                  .Attr<std::int64_t>("present")
                                  .Attr<std::int64_t>("oracle"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdaJaxBackward, KdaBackwardImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<double>("scale")
                                  .Attr<double>("lower_bound")
                                  .Attr<std::int64_t>("flags")
                                  .Attr<std::int64_t>("chunk_size")
                                  .Attr<std::int64_t>("max_num_segments")
                                  .Attr<std::int64_t>("present")
                                  .Attr<std::int64_t>("oracle"));

// Called from NB_MODULE in bindings.cpp: _libkda.jax_ffi_targets() -> {name: PyCapsule}.
void kda_register_jax_ffi(nb::module_& m) {
  m.def(
      "jax_ffi_targets",
      [] {
        nb::dict d;
        d["libkda_kda_forward"] = nb::capsule(reinterpret_cast<void*>(&KdaJaxForward));
        d["libkda_kda_backward"] = nb::capsule(reinterpret_cast<void*>(&KdaJaxBackward));
        return d;
      },
      "XLA FFI handlers (CPU) of the forward and backward, as PyCapsules for jax.ffi.register_ffi_target.");
}

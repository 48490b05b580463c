// Thin nanobind bindings of the libkda forward, backward and decode (include/kda/ops.hpp) for the numpy
// package python/libkda. Each tensor arrives as (array, dtype code): the code names the element type
// because numpy has no DLPack code for bfloat16 (bf16 arrays come in as a uint16 view).
// Arrays are wrapped, never copied: nanobind gives element strides, which is what
// kda::TensorView takes. All shape and semantic checks are the library's (its messages name
// the argument); a failed kda::Status becomes a Python ValueError with that message verbatim.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "kda/kda.hpp"

namespace nb = nanobind;

namespace {

using InArray = nb::ndarray<nb::ro, nb::device::cpu>;  // inputs: read-only views accepted
using OutArray = nb::ndarray<nb::device::cpu>;         // outputs: must be writable
using In = std::optional<std::pair<InArray, std::string>>;
using Out = std::optional<std::pair<OutArray, std::string>>;

kda::DType parse_dtype(const std::string& code, const char* name) {
  if (code == "f32") return kda::DType::kF32;
  if (code == "bf16") return kda::DType::kBF16;
  if (code == "f16") return kda::DType::kF16;
  if (code == "f64") return kda::DType::kF64;
  if (code == "i32") return kda::DType::kI32;
  if (code == "i64") return kda::DType::kI64;
  throw nb::value_error(("kda: argument '" + std::string(name) +
                         "': expected dtype code f32, bf16, f16, f64, i32 or i64, got '" + code + "'")
                            .c_str());
}

template <typename Array>
kda::TensorView make_view(const std::optional<std::pair<Array, std::string>>& arg, const char* name) {
  kda::TensorView t;  // ndim = -1: not given
  if (!arg) return t;
  const Array& a = arg->first;
  t.dtype = parse_dtype(arg->second, name);
  if (a.itemsize() != kda::dtype_size(t.dtype)) {
    throw nb::value_error(("kda: argument '" + std::string(name) + "': dtype code '" + arg->second + "' needs " +
                           std::to_string(kda::dtype_size(t.dtype)) + "-byte elements, got an array of " +
                           std::to_string(a.itemsize()) + "-byte elements")
                              .c_str());
  }
  if (a.ndim() > static_cast<std::size_t>(kda::kMaxDims)) {
    throw nb::value_error(("kda: argument '" + std::string(name) + "': at most " + std::to_string(kda::kMaxDims) +
                           " dims, got " + std::to_string(a.ndim()))
                              .c_str());
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<std::int64_t>(a.shape(i));
    t.strides[i] = a.stride(i);
  }
  return t;
}

kda::Path parse_path(const std::string& path) {
  if (path == "fused") return kda::Path::kFused;
  if (path == "staged") return kda::Path::kStaged;
  throw nb::value_error(("kda: option 'path': expected 'fused' or 'staged', got '" + path + "'").c_str());
}

// The options shared by the forward and decode (chunk_size and path are the forward's own).
kda::Options make_options(std::optional<double> scale, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,
                          std::optional<double> lower_bound, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,
                          bool state_v_first, int num_threads) {
  kda::Options opt;
  opt.scale = scale ? *scale : NAN;
  opt.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
  opt.use_gate_in_kernel = use_gate_in_kernel;
  opt.has_lower_bound = lower_bound.has_value();
  opt.lower_bound = lower_bound ? *lower_bound : 0.0;
  opt.use_beta_sigmoid_in_kernel = use_beta_sigmoid_in_kernel;
  opt.allow_neg_eigval = allow_neg_eigval;
  opt.state_layout = state_v_first ? kda::StateLayout::kVFirst : kda::StateLayout::kKFirst;
  opt.num_threads = num_threads;
  return opt;
}

// The forward's inputs and options, shared by every entry point (forward, forward_chunk_count,
// backward). Outputs (o, final_state, chunk_states) are set by the caller.
kda::ForwardParams forward_params(const In& q, const In& k, const In& v, const In& g, const In& beta, const In& A_log,
                                  const In& dt_bias, const In& cu_seqlens, const In& segment_ids,
                                  std::int64_t max_num_segments, const In& initial_state,
                                  const In& initial_state_indices, std::optional<double> scale,
                                  bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,
                                  std::optional<double> lower_bound, bool use_beta_sigmoid_in_kernel,
                                  bool allow_neg_eigval, int chunk_size, bool state_v_first, const std::string& path,
                                  int num_threads, bool bf16_dot_products) {
  kda::ForwardParams p;
  p.q = make_view(q, "q");
  p.k = make_view(k, "k");
  p.v = make_view(v, "v");
  p.g = make_view(g, "g");
  p.beta = make_view(beta, "beta");
  p.A_log = make_view(A_log, "A_log");
  p.dt_bias = make_view(dt_bias, "dt_bias");
  p.cu_seqlens = make_view(cu_seqlens, "cu_seqlens");
  p.segment_ids = make_view(segment_ids, "segment_ids");
  p.max_num_segments = max_num_segments;
  p.initial_state = make_view(initial_state, "initial_state");
  p.initial_state_indices = make_view(initial_state_indices, "initial_state_indices");
  p.options = make_options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, state_v_first, num_threads);
  p.options.chunk_size = chunk_size;
  p.options.path = parse_path(path);
  p.options.bf16_dot_products = bf16_dot_products;
  return p;
}

// Runs fn() without the GIL; a failed status becomes ValueError(message).
template <typename Fn>
void call(Fn&& fn) {
  kda::Status status;
  {
    nb::gil_scoped_release release;
    status = fn();
  }
  if (!status.ok()) throw nb::value_error(status.message().c_str());
}

// The forward's Python signature: every input and option, then the outputs.
#define KDA_FORWARD_ARGS                                                                                   \
  const In &q, const In &k, const In &v, const In &g, const In &beta, const In &A_log, const In &dt_bias,  \
      const In &cu_seqlens, const In &segment_ids, std::int64_t max_num_segments, const In &initial_state, \
      const In &initial_state_indices, std::optional<double> scale, bool use_qk_l2norm_in_kernel,          \
      bool use_gate_in_kernel, std::optional<double> lower_bound, bool use_beta_sigmoid_in_kernel,         \
      bool allow_neg_eigval, int chunk_size, bool state_v_first, const std::string &path, int num_threads, \
      bool bf16_dot_products
#define KDA_FORWARD_PARAMS                                                                                   \
  forward_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, segment_ids, max_num_segments, initial_state, \
                 initial_state_indices, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,     \
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_size, state_v_first, path, num_threads, \
                 bf16_dot_products)

using ForwardEntry = kda::Status (*)(const kda::ForwardParams&);
using BackwardEntry = kda::Status (*)(const kda::BackwardParams&);

template <ForwardEntry entry>
void forward_entry(KDA_FORWARD_ARGS, const Out& o, const Out& final_state, const Out& chunk_states, const Out& v_new) {
  kda::ForwardParams p = KDA_FORWARD_PARAMS;
  p.o = make_view(o, "o");
  p.final_state = make_view(final_state, "final_state");
  p.chunk_states = make_view(chunk_states, "chunk_states");
  p.v_new = make_view(v_new, "v_new");
  call([&] { return entry(p); });
}

// NC for the chunk_states output. o must be given (the whole forward is validated).
std::int64_t chunk_count_entry(KDA_FORWARD_ARGS, const Out& o, const Out& final_state, const Out& chunk_states,
                               const Out& v_new) {
  kda::ForwardParams p = KDA_FORWARD_PARAMS;
  p.o = make_view(o, "o");
  p.final_state = make_view(final_state, "final_state");
  p.chunk_states = make_view(chunk_states, "chunk_states");
  p.v_new = make_view(v_new, "v_new");
  std::int64_t nc = 0;
  call([&] { return kda::forward_chunk_count(p, &nc); });
  return nc;
}

template <BackwardEntry entry>
void backward_entry(KDA_FORWARD_ARGS, const In& chunk_states, const In& v_new, const In& d_o, const In& d_final_state,
                    const Out& dq, const Out& dk, const Out& dv, const Out& dg, const Out& dbeta, const Out& dh0,
                    const Out& dA_log, const Out& ddt_bias) {
  kda::BackwardParams p;
  p.forward = KDA_FORWARD_PARAMS;
  p.forward.chunk_states = make_view(chunk_states, "chunk_states");
  p.forward.v_new = make_view(v_new, "v_new");
  p.d_o = make_view(d_o, "d_o");
  p.d_final_state = make_view(d_final_state, "d_final_state");
  p.dq = make_view(dq, "dq");
  p.dk = make_view(dk, "dk");
  p.dv = make_view(dv, "dv");
  p.dg = make_view(dg, "dg");
  p.dbeta = make_view(dbeta, "dbeta");
  p.dh0 = make_view(dh0, "dh0");
  p.dA_log = make_view(dA_log, "dA_log");
  p.ddt_bias = make_view(ddt_bias, "ddt_bias");
  call([&] { return entry(p); });
}

#undef KDA_FORWARD_ARGS
#undef KDA_FORWARD_PARAMS

// kda::decode: the pool is an output view (updated in place, never copied); o is written.
void decode_entry(const In& q, const In& k, const In& v, const In& g, const In& beta, const In& A_log,
                  const In& dt_bias, const Out& state_pool, const In& slot_indices, const In& num_accepted_tokens,
                  std::optional<double> scale, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,
                  std::optional<double> lower_bound, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,
                  bool state_v_first, int num_threads, const Out& o) {
  kda::DecodeParams p;
  p.q = make_view(q, "q");
  p.k = make_view(k, "k");
  p.v = make_view(v, "v");
  p.g = make_view(g, "g");
  p.beta = make_view(beta, "beta");
  p.A_log = make_view(A_log, "A_log");
  p.dt_bias = make_view(dt_bias, "dt_bias");
  p.state_pool = make_view(state_pool, "state_pool");
  p.slot_indices = make_view(slot_indices, "slot_indices");
  p.num_accepted_tokens = make_view(num_accepted_tokens, "num_accepted_tokens");
  p.o = make_view(o, "o");
  p.options = make_options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, state_v_first, num_threads);
  call([&] { return kda::decode(p); });
}

#define KDA_FORWARD_NB_ARGS                                                                              \
  nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::kw_only(),                \
      nb::arg("A_log").none() = nb::none(), nb::arg("dt_bias").none() = nb::none(),                      \
      nb::arg("cu_seqlens").none() = nb::none(), nb::arg("segment_ids").none() = nb::none(),             \
      nb::arg("max_num_segments") = 0, nb::arg("initial_state").none() = nb::none(),                     \
      nb::arg("initial_state_indices").none() = nb::none(), nb::arg("scale").none() = nb::none(),        \
      nb::arg("use_qk_l2norm_in_kernel") = false, nb::arg("use_gate_in_kernel") = false,                 \
      nb::arg("lower_bound").none() = nb::none(), nb::arg("use_beta_sigmoid_in_kernel") = false,         \
      nb::arg("allow_neg_eigval") = false, nb::arg("chunk_size") = 64, nb::arg("state_v_first") = false, \
      nb::arg("path") = "fused", nb::arg("num_threads") = 0, nb::arg("bf16_dot_products") = true

template <typename Fn>
void def_forward(nb::module_& m, const char* name, Fn fn, const char* doc) {
  m.def(name, fn, KDA_FORWARD_NB_ARGS, nb::arg("o"), nb::arg("final_state").none() = nb::none(),
        nb::arg("chunk_states").none() = nb::none(), nb::arg("v_new").none() = nb::none(), doc);
}

template <typename Fn>
void def_backward(nb::module_& m, const char* name, Fn fn, const char* doc) {
  m.def(name, fn, KDA_FORWARD_NB_ARGS, nb::arg("chunk_states").none() = nb::none(),
        nb::arg("v_new").none() = nb::none(), nb::arg("d_o"), nb::arg("d_final_state").none() = nb::none(),
        nb::arg("dq").none() = nb::none(), nb::arg("dk").none() = nb::none(), nb::arg("dv").none() = nb::none(),
        nb::arg("dg").none() = nb::none(), nb::arg("dbeta").none() = nb::none(), nb::arg("dh0").none() = nb::none(),
        nb::arg("dA_log").none() = nb::none(), nb::arg("ddt_bias").none() = nb::none(), doc);
}

#undef KDA_FORWARD_NB_ARGS

}  // namespace

// Raw-pointer entry points (python/src/raw.cpp) and, when built against the XLA FFI headers, the
// JAX custom-call handlers (python/src/jax_ffi.cpp).
void kda_register_raw(nb::module_& m);
#ifdef KDA_HAVE_JAX_FFI
void kda_register_jax_ffi(nb::module_& m);
#endif

NB_MODULE(_libkda, m) {
  m.doc() = "libkda: Kimi Delta Attention CPU kernels (low-level bindings; use the libkda package)";

  def_forward(m, "forward", &forward_entry<&kda::chunk_forward>,
              "The chunked forward (kda::chunk_forward). Every tensor is an (array, dtype code) pair; "
              "o, final_state, chunk_states (the state entering every chunk) and v_new (every token's delta, "
              "the backward's optional residual) are written in place. Raises ValueError with the library's message.");
  def_forward(m, "reference_forward", &forward_entry<&kda::reference_forward>,
              "The fp64 token-by-token oracle (kda::reference_forward); same arguments as forward.");
  def_forward(m, "forward_chunk_count", &chunk_count_entry,
              "NC, the leading dim of the chunk_states output (kda::forward_chunk_count); same arguments "
              "as forward (which are validated; nothing is written).");
  def_backward(m, "backward", &backward_entry<&kda::chunk_backward>,
               "The chunked backward (kda::chunk_backward). Forward inputs and options as in forward; "
               "chunk_states (the forward's, read) selects the saved-state policy, absent = "
               "rematerialized; v_new (the forward's, read) replaces the recomputed token deltas. d_o is required, "
               "d_final_state optional; the gradients dq, dk, dv, dg, "
               "dbeta, dh0, dA_log, ddt_bias are each optional outputs written in place.");
  def_backward(m, "reference_backward", &backward_entry<&kda::reference_backward>,
               "The fp64 adjoint oracle (kda::reference_backward); same arguments as backward.");

  m.def("decode", &decode_entry, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::kw_only(),
        nb::arg("A_log").none() = nb::none(), nb::arg("dt_bias").none() = nb::none(), nb::arg("state_pool").none(),
        nb::arg("slot_indices").none(), nb::arg("num_accepted_tokens").none() = nb::none(),
        nb::arg("scale").none() = nb::none(), nb::arg("use_qk_l2norm_in_kernel") = false,
        nb::arg("use_gate_in_kernel") = false, nb::arg("lower_bound").none() = nb::none(),
        nb::arg("use_beta_sigmoid_in_kernel") = false, nb::arg("allow_neg_eigval") = false,
        nb::arg("state_v_first") = false, nb::arg("num_threads") = 0, nb::arg("o"),
        "Decode against a state pool (kda::decode): T tokens per sequence, token by token. state_pool "
        "(fp32 [slots, HV, K, V], V-first [slots, HV, V, K]) is updated in place through slot_indices "
        "([N] or [N, T]) and num_accepted_tokens ([N], optional); o [N, T, HV, V] is written. Raises "
        "ValueError with the library's message; on error nothing is written.");

  m.def(
      "version", [] { return std::string(kda::version()); }, "Library version, MAJOR.MINOR.PATCH.");
  m.def(
      "cpu_target", [] { return std::string(kda::cpu_target()); }, "The CPU kernel target chosen at run time.");
  m.def(
      "cpu_bf16_dot_products", [] { return kda::cpu_bf16_dot_products(); },
      "Whether bf16 inputs' state products run as bf16 dot products (kda::cpu_bf16_dot_products).");
  m.def(
      "memory_stats",
      [] {
        const kda::MemoryStats s = kda::memory_stats();
        return std::make_tuple(s.current_bytes, s.peak_bytes);
      },
      "(current_bytes, peak_bytes) of the library's accounting allocator.");
  m.def("reset_peak_memory", &kda::reset_peak_memory, "Sets the peak to the current usage.");
  kda_register_raw(m);
#ifdef KDA_HAVE_JAX_FFI
  kda_register_jax_ffi(m);
#endif
}

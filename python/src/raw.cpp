// Raw-pointer entry points of the libkda bindings, for frameworks that own their tensors (the
// PyTorch integration, python/libkda/torch.py). Every tensor arrives as a descriptor tuple
//   (data_ptr: int, dtype: int, shape: tuple[int], strides: tuple[int])   or None (absent)
// with element strides and the dtype numbered as kda::DType (0 f32, 1 bf16, 2 f16, 3 f64, 4 i32,
// 5 i64). Nothing is copied or converted: the pointers go straight into kda::TensorView, so a
// torch tensor of any strides (batch-first or head-first, SPEC.md 1.1) is read in place. The
// arguments are positional and the options packed into one flags word, to keep the per-call cost
// of argument parsing to a minimum (decode-sized calls are dominated by it).
//
// The caller guarantees that the pointers are valid CPU memory for the given shapes and strides
// for the duration of the call (python/libkda/torch.py passes tensor.data_ptr() of live CPU
// tensors). All shape, dtype and semantic checks are the library's; a failed kda::Status becomes
// a Python ValueError with its message verbatim.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kda/kda.hpp"

namespace nb = nanobind;

namespace {

// Option bits of the `flags` argument (python/libkda/torch.py mirrors them).
constexpr std::int64_t kL2Norm = 1;
constexpr std::int64_t kGateInKernel = 2;
constexpr std::int64_t kBetaSigmoid = 4;
constexpr std::int64_t kAllowNegEigval = 8;
constexpr std::int64_t kVFirst = 16;
constexpr std::int64_t kFp32Products = 32;  // Options::bf16_dot_products = false

[[noreturn]] void bad_descriptor(const char* name, const char* what) {
  throw nb::value_error((std::string("kda: argument '") + name + "': bad tensor descriptor (" + what + ")").c_str());
}

std::int64_t as_int(PyObject* o, const char* name) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    bad_descriptor(name, "expected integers");
  }
  return static_cast<std::int64_t>(v);
}

// A descriptor tuple (or None) as a TensorView. Only the CPython tuple API: this runs once per
// tensor per call.
kda::TensorView view_of(PyObject* d, const char* name) {
  kda::TensorView t;  // ndim = -1: not given
  if (d == Py_None) return t;
  if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 4) bad_descriptor(name, "expected (ptr, dtype, shape, strides)");
  const std::int64_t ptr = as_int(PyTuple_GET_ITEM(d, 0), name);
  const std::int64_t code = as_int(PyTuple_GET_ITEM(d, 1), name);
  PyObject* shape = PyTuple_GET_ITEM(d, 2);
  PyObject* strides = PyTuple_GET_ITEM(d, 3);
  if (code < 0 || code > static_cast<std::int64_t>(kda::DType::kI64))
    bad_descriptor(name, "unsupported dtype; expected float32, bfloat16, float16, float64, int32 or int64");
  if (!PyTuple_Check(shape) || !PyTuple_Check(strides)) bad_descriptor(name, "shape and strides must be tuples");
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
  if (PyTuple_GET_SIZE(strides) != ndim) bad_descriptor(name, "shape and strides differ in length");
  if (ndim > kda::kMaxDims) {
    throw nb::value_error((std::string("kda: argument '") + name + "': at most " + std::to_string(kda::kMaxDims) +
                           " dims, got " + std::to_string(ndim))
                              .c_str());
  }
  t.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
  t.dtype = static_cast<kda::DType>(code);
  t.ndim = static_cast<int>(ndim);
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    t.shape[i] = as_int(PyTuple_GET_ITEM(shape, i), name);
    t.strides[i] = as_int(PyTuple_GET_ITEM(strides, i), name);
  }
  return t;
}

kda::TensorView item(const nb::tuple& tensors, Py_ssize_t i, const char* name) {
  return view_of(PyTuple_GET_ITEM(tensors.ptr(), i), name);
}

void expect_count(const nb::tuple& tensors, Py_ssize_t n, const char* fn) {
  if (PyTuple_GET_SIZE(tensors.ptr()) != n) {
    throw nb::value_error((std::string("kda: ") + fn + ": expected " + std::to_string(n) + " tensor descriptors, got " +
                           std::to_string(PyTuple_GET_SIZE(tensors.ptr())))
                              .c_str());
  }
}

kda::Options options_of(double scale, double lower_bound, std::int64_t flags, std::int64_t num_threads) {
  kda::Options opt;
  opt.scale = scale;  // NaN: the default K^-0.5
  opt.use_qk_l2norm_in_kernel = (flags & kL2Norm) != 0;
  opt.use_gate_in_kernel = (flags & kGateInKernel) != 0;
  opt.has_lower_bound = !std::isnan(lower_bound);
  opt.lower_bound = opt.has_lower_bound ? lower_bound : 0.0;
  opt.use_beta_sigmoid_in_kernel = (flags & kBetaSigmoid) != 0;
  opt.allow_neg_eigval = (flags & kAllowNegEigval) != 0;
  opt.state_layout = (flags & kVFirst) ? kda::StateLayout::kVFirst : kda::StateLayout::kKFirst;
  opt.bf16_dot_products = (flags & kFp32Products) == 0;
  opt.num_threads = static_cast<int>(num_threads);
  return opt;
}

// The forward's 15 descriptors, in this order:
//   q, k, v, g, beta, A_log, dt_bias, cu_seqlens, segment_ids, initial_state, initial_state_indices,
//   o, final_state, chunk_states, v_new
constexpr Py_ssize_t kForwardTensors = 15;

kda::ForwardParams forward_params(const nb::tuple& t, std::int64_t max_num_segments, double scale, double lower_bound,
                                  std::int64_t flags, std::int64_t chunk_size, std::int64_t path,
                                  std::int64_t num_threads) {
  kda::ForwardParams p;
  p.q = item(t, 0, "q");
  p.k = item(t, 1, "k");
  p.v = item(t, 2, "v");
  p.g = item(t, 3, "g");
  p.beta = item(t, 4, "beta");
  p.A_log = item(t, 5, "A_log");
  p.dt_bias = item(t, 6, "dt_bias");
  p.cu_seqlens = item(t, 7, "cu_seqlens");
  p.segment_ids = item(t, 8, "segment_ids");
  p.initial_state = item(t, 9, "initial_state");
  p.initial_state_indices = item(t, 10, "initial_state_indices");
  p.o = item(t, 11, "o");
  p.final_state = item(t, 12, "final_state");
  p.chunk_states = item(t, 13, "chunk_states");
  p.v_new = item(t, 14, "v_new");
  p.max_num_segments = max_num_segments;
  p.options = options_of(scale, lower_bound, flags, num_threads);
  p.options.chunk_size = static_cast<int>(chunk_size);
  p.options.path = path == 1 ? kda::Path::kStaged : kda::Path::kFused;
  return p;
}

template <typename Fn>
void run(Fn&& fn) {
  kda::Status status;
  {
    nb::gil_scoped_release release;
    status = fn();
  }
  if (!status.ok()) throw nb::value_error(status.message().c_str());
}

// chunk_states may be given with a leading dim larger than NC (a capacity: frameworks that need
// output shapes independent of the cu_seqlens / segment_ids values allocate an upper bound). The
// view is trimmed to the first NC entries here. Returns NC (0 without chunk_states).
std::int64_t trim_chunk_states(kda::ForwardParams& p) {
  if (!p.chunk_states.defined()) return 0;
  kda::ForwardParams counting = p;
  counting.chunk_states = kda::TensorView();
  counting.final_state = kda::TensorView();
  std::int64_t nc = 0;
  run([&] { return kda::forward_chunk_count(counting, &nc); });
  if (p.chunk_states.ndim >= 1 && p.chunk_states.shape[0] > nc) p.chunk_states.shape[0] = nc;
  return nc;
}

// entry: 0 chunk_forward, 1 reference_forward, 2 forward_chunk_count (nothing written).
// Returns NC, the number of chunk states (when chunk_states is given or entry is 2), else 0.
std::int64_t raw_forward(int entry, const nb::tuple& tensors, std::int64_t max_num_segments, double scale,
                         double lower_bound, std::int64_t flags, std::int64_t chunk_size, std::int64_t path,
                         std::int64_t num_threads) {
  expect_count(tensors, kForwardTensors, "raw_forward");
  kda::ForwardParams p =
      forward_params(tensors, max_num_segments, scale, lower_bound, flags, chunk_size, path, num_threads);
  if (entry == 2) {
    std::int64_t nc = 0;
    run([&] { return kda::forward_chunk_count(p, &nc); });
    return nc;
  }
  const std::int64_t nc = (entry == 0 || entry == 1) ? trim_chunk_states(p) : 0;
  if (entry == 0) {
    run([&] { return kda::chunk_forward(p); });
  } else if (entry == 1) {
    run([&] { return kda::reference_forward(p); });
  } else {
    throw nb::value_error("kda: raw_forward: entry must be 0, 1 or 2");
  }
  return nc;
}

// The backward's 25 descriptors: the forward's 15 (o and final_state are ignored; chunk_states,
// when given, is the forward's saved states, possibly with a larger capacity; v_new the
// forward's token deltas) then
//   d_o, d_final_state, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias
// entry: 0 chunk_backward, 1 reference_backward.
void raw_backward(int entry, const nb::tuple& tensors, std::int64_t max_num_segments, double scale, double lower_bound,
                  std::int64_t flags, std::int64_t chunk_size, std::int64_t path, std::int64_t num_threads) {
  expect_count(tensors, kForwardTensors + 10, "raw_backward");
  kda::BackwardParams p;
  p.forward = forward_params(tensors, max_num_segments, scale, lower_bound, flags, chunk_size, path, num_threads);
  p.forward.o = kda::TensorView();
  p.forward.final_state = kda::TensorView();
  if (entry == 0) trim_chunk_states(p.forward);
  p.d_o = item(tensors, kForwardTensors + 0, "d_o");
  p.d_final_state = item(tensors, kForwardTensors + 1, "d_final_state");
  p.dq = item(tensors, kForwardTensors + 2, "dq");
  p.dk = item(tensors, kForwardTensors + 3, "dk");
  p.dv = item(tensors, kForwardTensors + 4, "dv");
  p.dg = item(tensors, kForwardTensors + 5, "dg");
  p.dbeta = item(tensors, kForwardTensors + 6, "dbeta");
  p.dh0 = item(tensors, kForwardTensors + 7, "dh0");
  p.dA_log = item(tensors, kForwardTensors + 8, "dA_log");
  p.ddt_bias = item(tensors, kForwardTensors + 9, "ddt_bias");
  if (entry == 0) {
    run([&] { return kda::chunk_backward(p); });
  } else if (entry == 1) {
    p.forward.chunk_states = kda::TensorView();  // the oracle keeps fp64 checkpoints of its own
    p.forward.v_new = kda::TensorView();
    run([&] { return kda::reference_backward(p); });
  } else {
    throw nb::value_error("kda: raw_backward: entry must be 0 or 1");
  }
}

// kda::decode. Descriptors: q, k, v, g, beta, A_log, dt_bias, state_pool (updated in place),
// slot_indices, num_accepted_tokens, o.
void raw_decode(const nb::tuple& tensors, double scale, double lower_bound, std::int64_t flags,
                std::int64_t num_threads) {
  expect_count(tensors, 11, "raw_decode");
  kda::DecodeParams p;
  p.q = item(tensors, 0, "q");
  p.k = item(tensors, 1, "k");
  p.v = item(tensors, 2, "v");
  p.g = item(tensors, 3, "g");
  p.beta = item(tensors, 4, "beta");
  p.A_log = item(tensors, 5, "A_log");
  p.dt_bias = item(tensors, 6, "dt_bias");
  p.state_pool = item(tensors, 7, "state_pool");
  p.slot_indices = item(tensors, 8, "slot_indices");
  p.num_accepted_tokens = item(tensors, 9, "num_accepted_tokens");
  p.o = item(tensors, 10, "o");
  p.options = options_of(scale, lower_bound, flags, num_threads);
  run([&] { return kda::decode(p); });
}

}  // namespace

// Called from NB_MODULE in bindings.cpp.
void kda_register_raw(nb::module_& m) {
  m.def("raw_forward", &raw_forward, nb::arg("entry"), nb::arg("tensors"), nb::arg("max_num_segments"),
        nb::arg("scale"), nb::arg("lower_bound"), nb::arg("flags"), nb::arg("chunk_size"), nb::arg("path"),
        nb::arg("num_threads"),
        "Raw-pointer forward (entry 0: kda::chunk_forward, 1: kda::reference_forward, 2: "
        "kda::forward_chunk_count). tensors: 15 descriptors (ptr, dtype, shape, strides) or None -- q, k, "
        "v, g, beta, A_log, dt_bias, cu_seqlens, segment_ids, initial_state, initial_state_indices, o, "
        "final_state, chunk_states (leading dim may exceed NC: trimmed), v_new. scale / lower_bound: NaN = "
        "default / none. flags: 1 l2norm, 2 gate in kernel, 4 beta sigmoid, 8 allow_neg_eigval, 16 "
        "V-first. path: 0 fused, 1 staged. Returns NC (0 without chunk_states).");
  m.def("raw_backward", &raw_backward, nb::arg("entry"), nb::arg("tensors"), nb::arg("max_num_segments"),
        nb::arg("scale"), nb::arg("lower_bound"), nb::arg("flags"), nb::arg("chunk_size"), nb::arg("path"),
        nb::arg("num_threads"),
        "Raw-pointer backward (entry 0: kda::chunk_backward, 1: kda::reference_backward). tensors: the "
        "forward's 15 descriptors then d_o, d_final_state, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias.");
  m.def("raw_decode", &raw_decode, nb::arg("tensors"), nb::arg("scale"), nb::arg("lower_bound"), nb::arg("flags"),
        nb::arg("num_threads"),
        "Raw-pointer kda::decode. tensors: q, k, v, g, beta, A_log, dt_bias, state_pool (in place), "
        "slot_indices, num_accepted_tokens, o.");
  m.attr("RAW_FLAGS") = nb::make_tuple(kL2Norm, kGateInKernel, kBetaSigmoid, kAllowNegEigval, kVFirst, kFp32Products);
}

#include "test_util.hpp"

#include <cstdlib>

namespace kda::test {
namespace {

float bf16_round(double x) {
  float f = static_cast<float>(x);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void HostTensor::set(std::int64_t i, double x) {
  void* p = bytes.data();
  switch (view.dtype) {
    case DType::kF32:
      static_cast<float*>(p)[i] = static_cast<float>(x);
      break;
    case DType::kF64:
      static_cast<double*>(p)[i] = x;
      break;
    case DType::kBF16: {
      float f = bf16_round(x);
      std::uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<std::uint16_t*>(p)[i] = static_cast<std::uint16_t>(u >> 16);
      break;
    }
    case DType::kF16: {
      Half h = static_cast<Half>(static_cast<float>(x));
      std::memcpy(static_cast<std::uint16_t*>(p) + i, &h, 2);
      break;
    }
    case DType::kI32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(x);
      break;
    case DType::kI64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(x);
      break;
  }
}

double HostTensor::get(std::int64_t i) const {
  const void* p = bytes.data();
  switch (view.dtype) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kF64:
      return static_cast<const double*>(p)[i];
    case DType::kBF16: {
      std::uint32_t u = static_cast<std::uint32_t>(static_cast<const std::uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DType::kF16: {
      Half h;
      std::memcpy(&h, static_cast<const std::uint16_t*>(p) + i, 2);
      return static_cast<float>(h);
    }
    case DType::kI32:
      return static_cast<const std::int32_t*>(p)[i];
    case DType::kI64:
      return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
  }
  return 0;
}

Inputs make_inputs(const Case& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  Inputs in;
  in.q = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  in.k = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  in.v = HostTensor(c.dtype, {c.B, c.T, c.HV, c.V});
  in.g = HostTensor(c.dtype, {c.B, c.T, c.HV, c.K});
  in.beta = HostTensor(c.dtype, {c.B, c.T, c.HV});
  // q, k: without the in-kernel l2norm, rows are normalized here (the delta rule needs
  // ||k|| <= 1 to stay stable, as in FLA's tests).
  const std::int64_t rows = c.B * c.T * c.H;
  std::vector<double> row(c.K);
  for (HostTensor* t : {&in.q, &in.k}) {
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (auto& x : row) {
        x = normal(rng);
        ss += x * x;
      }
      const double s = c.l2norm ? 1.0 : 1.0 / std::sqrt(ss);
      for (std::int64_t d = 0; d < c.K; ++d) t->set(r * c.K + d, row[d] * s);
    }
  }
  for (std::int64_t i = 0; i < in.v.numel(); ++i) in.v.set(i, normal(rng));
  for (std::int64_t i = 0; i < in.g.numel(); ++i) {
    double x = normal(rng);
    if (c.extreme_gates) {
      in.g.set(i, uni(rng) < 0.5 ? -1000.0 : 0.0);
    } else if (c.gate == Gate::kLogDecay && c.gate_center != 0.0) {
      in.g.set(i, c.gate_center * (0.5 + uni(rng)));
    } else if (c.gate != Gate::kLogDecay && c.gate_center != 0.0) {
      in.g.set(i, x + c.gate_center);
    } else if (c.gate == Gate::kLogDecay) {
      in.g.set(i, -std::log1p(std::exp(-(x + 2.0))) * 0.5);  // logsigmoid(x + 2) / 2: long memory
    } else {
      in.g.set(i, x);
    }
  }
  for (std::int64_t i = 0; i < in.beta.numel(); ++i) {
    const double x = normal(rng);
    in.beta.set(i, c.beta_sigmoid ? x : 1.0 / (1.0 + std::exp(-x)));
  }
  if (c.gate != Gate::kLogDecay) {
    in.has_A_log = true;
    in.A_log = HostTensor(DType::kF32, {c.HV});
    for (std::int64_t i = 0; i < c.HV; ++i) in.A_log.set(i, std::log(1.0 + 15.0 * uni(rng)) - 2.0);
    in.has_dt_bias = true;
    in.dt_bias = HostTensor(DType::kF32, {c.HV * c.K});
    for (std::int64_t i = 0; i < c.HV * c.K; ++i) in.dt_bias.set(i, 0.5 * normal(rng));
  }
  const std::int64_t n = c.num_states();
  in.h0 = c.layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {n, c.HV, c.K, c.V})
                                           : HostTensor(DType::kF32, {n, c.HV, c.V, c.K});
  for (std::int64_t i = 0; i < in.h0.numel(); ++i) in.h0.set(i, 0.5 * normal(rng));
  if (!c.cu_seqlens.empty()) {
    in.cu = HostTensor(DType::kI64, {static_cast<std::int64_t>(c.cu_seqlens.size())});
    for (std::size_t i = 0; i < c.cu_seqlens.size(); ++i)
      in.cu.set(static_cast<std::int64_t>(i), static_cast<double>(c.cu_seqlens[i]));
  }
  if (!c.segment_ids.empty()) {
    const bool two_d = static_cast<std::int64_t>(c.segment_ids.size()) == c.B * c.T && c.B > 1;
    in.ids = two_d ? HostTensor(DType::kI32, {c.B, c.T}) : HostTensor(DType::kI32, {c.T});
    for (std::size_t i = 0; i < c.segment_ids.size(); ++i) in.ids.set(static_cast<std::int64_t>(i), c.segment_ids[i]);
  }
  return in;
}

Inputs slice_sequence(const Case& c, const Inputs& in, std::int64_t b, std::int64_t start, std::int64_t len,
                      std::int64_t state) {
  Inputs out;
  auto cut = [&](const HostTensor& src, std::initializer_list<std::int64_t> shape) {
    HostTensor dst(src.view.dtype, shape);
    const std::size_t es = dtype_size(src.view.dtype);
    const std::size_t row = static_cast<std::size_t>(src.numel() / (c.B * c.T)) * es;
    if (len > 0) {
      std::memcpy(dst.bytes.data(), src.bytes.data() + static_cast<std::size_t>(b * c.T + start) * row,
                  static_cast<std::size_t>(len) * row);
    }
    return dst;
  };
  out.q = cut(in.q, {1, len, c.H, c.K});
  out.k = cut(in.k, {1, len, c.H, c.K});
  out.v = cut(in.v, {1, len, c.HV, c.V});
  out.g = cut(in.g, {1, len, c.HV, c.K});
  out.beta = cut(in.beta, {1, len, c.HV});
  out.A_log = in.A_log;
  out.dt_bias = in.dt_bias;
  out.has_A_log = in.has_A_log;
  out.has_dt_bias = in.has_dt_bias;
  out.h0 = c.layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {1, c.HV, c.K, c.V})
                                            : HostTensor(DType::kF32, {1, c.HV, c.V, c.K});
  std::memcpy(out.h0.bytes.data(), in.h0.bytes.data() + static_cast<std::size_t>(state) * out.h0.bytes.size(),
              out.h0.bytes.size());
  return out;
}

// [B*N, ...] flat state buffer viewed as [B, N, ...] for segment_ids calls.
TensorView state_view(const Case& c, const TensorView& t) {
  if (c.segment_ids.empty()) return t;
  TensorView r = t;
  r.ndim = 5;
  for (int i = 4; i >= 2; --i) {
    r.shape[i] = t.shape[i - 1];
    r.strides[i] = t.strides[i - 1];
  }
  r.shape[0] = c.B;
  r.shape[1] = c.max_num_segments;
  r.strides[1] = t.strides[0];
  r.strides[0] = t.strides[0] * c.max_num_segments;
  return r;
}

ForwardParams make_params(const Case& c, const Inputs& in, HostTensor& o, HostTensor& ht) {
  ForwardParams p;
  p.q = in.q.view;
  p.k = in.k.view;
  p.v = in.v.view;
  p.g = in.g.view;
  p.beta = in.beta.view;
  if (in.has_A_log) p.A_log = in.A_log.view;
  if (in.has_dt_bias) p.dt_bias = in.dt_bias.view;
  if (!c.cu_seqlens.empty()) p.cu_seqlens = in.cu.view;
  if (!c.segment_ids.empty()) {
    p.segment_ids = in.ids.view;
    p.max_num_segments = c.max_num_segments;
  }
  if (c.initial_state) p.initial_state = in.h0.view;
  p.o = o.view;
  if (c.final_state) p.final_state = ht.view;
  if (c.initial_state) p.initial_state = state_view(c, p.initial_state);
  if (c.final_state) p.final_state = state_view(c, p.final_state);
  p.options.use_qk_l2norm_in_kernel = c.l2norm;
  p.options.use_gate_in_kernel = c.gate != Gate::kLogDecay;
  p.options.has_lower_bound = c.gate == Gate::kLowerBound;
  p.options.lower_bound = -5.0f;
  p.options.use_beta_sigmoid_in_kernel = c.beta_sigmoid;
  p.options.allow_neg_eigval = c.neg_eigval;
  p.options.chunk_size = c.chunk;
  p.options.bf16_dot_products = c.bf16_dot_products;
  p.options.state_layout = c.layout;
  p.options.path = c.path;
  p.options.num_threads = c.threads;
  return p;
}

Outputs run_forward(const Case& c, const Inputs& in, bool oracle, bool want_v_new) {
  const DType out_dtype = oracle ? DType::kF64 : c.dtype;
  const DType state_dtype = oracle ? DType::kF64 : DType::kF32;
  const std::int64_t n = c.num_states();
  HostTensor o(out_dtype, {c.B, c.T, c.HV, c.V});
  o.fill(12345.0);  // every element must be written
  HostTensor ht = c.layout == StateLayout::kKFirst ? HostTensor(state_dtype, {n, c.HV, c.K, c.V})
                                                   : HostTensor(state_dtype, {n, c.HV, c.V, c.K});
  ht.fill(12345.0);
  ForwardParams p = make_params(c, in, o, ht);
  HostTensor v_new;
  if (want_v_new) {
    v_new = HostTensor(state_dtype, {c.B, c.T, c.HV, c.V});
    v_new.fill(12345.0);
    p.v_new = v_new.view;
  }
  Status s = oracle ? reference_forward(p) : chunk_forward(p);
  EXPECT_TRUE(s.ok()) << s.message() << "\n" << c.describe();
  Outputs out;
  out.o = o.to_double();
  if (c.final_state) out.ht = ht.to_double();
  if (want_v_new) out.v_new = v_new.to_double();
  return out;
}

std::string Metric::str() const {
  std::ostringstream os;
  os << "rel=" << rel << " max_abs=" << max_abs << " finite=" << finite;
  return os.str();
}

void expect_bitwise(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))))
      FAIL() << what << ": first mismatch at flat index " << i << ": " << a[i] << " vs " << b[i];
}

Metric compare(const std::vector<double>& out, const std::vector<double>& ref) {
  Metric m;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) m.finite = false;
    const double e = out[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
    m.max_abs = std::max(m.max_abs, std::fabs(e));
  }
  const double n = out.empty() ? 1.0 : static_cast<double>(out.size());
  m.rel = den > 0 ? std::sqrt(num / n) / std::sqrt(den / n) : std::sqrt(num / n);
  return m;
}

void expect_matches_oracle(const Case& c) {
  const Inputs in = make_inputs(c);
  const Outputs ref = run_forward(c, in, true);
  const Outputs out = run_forward(c, in, false);
  const double bound = forward_bound(c.dtype);
  const Metric mo = compare(out.o, ref.o);
  if (std::getenv("KDA_TEST_VERBOSE")) std::printf("o %s | %s\n", mo.str().c_str(), c.describe().c_str());
  EXPECT_TRUE(mo.finite && mo.rel <= bound) << "o: " << mo.str() << " bound=" << bound << "\n" << c.describe();
  if (c.final_state) {
    const Metric mh = compare(out.ht, ref.ht);
    if (std::getenv("KDA_TEST_VERBOSE")) std::printf("ht %s | %s\n", mh.str().c_str(), c.describe().c_str());
    EXPECT_TRUE(mh.finite && mh.rel <= bound) << "final_state: " << mh.str() << " bound=" << bound << "\n"
                                              << c.describe();
  }
}

Cotangents make_cotangents(const Case& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Cotangents ct;
  ct.d_o = HostTensor(c.dtype, {c.B, c.T, c.HV, c.V});
  for (std::int64_t i = 0; i < ct.d_o.numel(); ++i) ct.d_o.set(i, normal(rng));
  const std::int64_t n = c.num_states();
  ct.dht = c.layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {n, c.HV, c.K, c.V})
                                            : HostTensor(DType::kF32, {n, c.HV, c.V, c.K});
  for (std::int64_t i = 0; i < ct.dht.numel(); ++i) ct.dht.set(i, 0.3 * normal(rng));
  return ct;
}

Grads run_backward(const Case& c, const Inputs& in, const Cotangents& ct, bool oracle, Residuals residuals,
                   bool want_dh0, Path producer_path) {
  const DType gd = oracle ? DType::kF64 : c.dtype;
  const DType fd = oracle ? DType::kF64 : DType::kF32;
  const std::int64_t n = c.num_states();
  HostTensor o(gd, {c.B, c.T, c.HV, c.V}), ht(fd, {1});
  ForwardParams fwd = make_params(c, in, o, ht);
  fwd.final_state = TensorView{};
  HostTensor states, v_new;
  const bool keep_states = residuals == Residuals::kSaved || residuals == Residuals::kSavedVNew;
  const bool keep_v_new = residuals == Residuals::kSavedVNew || residuals == Residuals::kRematVNew;
  if (!oracle && keep_states) {
    std::int64_t nc = 0;
    const Status s = forward_chunk_count(fwd, &nc);
    EXPECT_TRUE(s.ok()) << s.message();
    states = c.layout == StateLayout::kKFirst ? HostTensor(DType::kF32, {nc, c.HV, c.K, c.V})
                                              : HostTensor(DType::kF32, {nc, c.HV, c.V, c.K});
    fwd.chunk_states = states.view;
  }
  if (!oracle && keep_v_new) {
    v_new = HostTensor(DType::kF32, {c.B, c.T, c.HV, c.V});
    v_new.fill(12345.0);  // every row is written (padding rows with zeros)
    fwd.v_new = v_new.view;
  }
  if (!oracle && (keep_states || keep_v_new)) {
    ForwardParams producer = fwd;
    producer.options.path = producer_path;
    const Status s = chunk_forward(producer);
    EXPECT_TRUE(s.ok()) << s.message();
  }
  BackwardParams bp;
  bp.forward = fwd;
  bp.d_o = ct.d_o.view;
  if (c.final_state) bp.d_final_state = state_view(c, ct.dht.view);
  HostTensor dq(gd, {c.B, c.T, c.H, c.K}), dk(gd, {c.B, c.T, c.H, c.K}), dv(gd, {c.B, c.T, c.HV, c.V}),
      dg(gd, {c.B, c.T, c.HV, c.K}), dbeta(gd, {c.B, c.T, c.HV});
  HostTensor dh0 =
      c.layout == StateLayout::kKFirst ? HostTensor(fd, {n, c.HV, c.K, c.V}) : HostTensor(fd, {n, c.HV, c.V, c.K});
  HostTensor dA_log(fd, {c.HV}), ddt_bias(fd, {c.HV * c.K});
  for (HostTensor* t : {&dq, &dk, &dv, &dg, &dbeta, &dh0, &dA_log, &ddt_bias}) t->fill(12345.0);
  bp.dq = dq.view, bp.dk = dk.view, bp.dv = dv.view, bp.dg = dg.view, bp.dbeta = dbeta.view;
  const bool has_dh0 = c.initial_state || want_dh0;
  if (has_dh0) bp.dh0 = state_view(c, dh0.view);
  if (in.has_A_log) bp.dA_log = dA_log.view;
  if (in.has_dt_bias) bp.ddt_bias = ddt_bias.view;
  const Status s = oracle ? reference_backward(bp) : chunk_backward(bp);
  EXPECT_TRUE(s.ok()) << s.message() << "\n" << c.describe();
  Grads g;
  g.dq = dq.to_double(), g.dk = dk.to_double(), g.dv = dv.to_double(), g.dg = dg.to_double();
  g.dbeta = dbeta.to_double();
  if (has_dh0) g.dh0 = dh0.to_double();
  if (in.has_A_log) g.dA_log = dA_log.to_double();
  if (in.has_dt_bias) g.ddt_bias = ddt_bias.to_double();
  return g;
}

void expect_backward_matches_oracle(const Case& c, Residuals residuals) {
  const Inputs in = make_inputs(c);
  const Cotangents ct = make_cotangents(c, c.seed + 99);
  const Grads ref = run_backward(c, in, ct, true);
  const Grads out = run_backward(c, in, ct, false, residuals);
  struct Item {
    const char* name;
    const std::vector<double>& a;
    const std::vector<double>& b;
    bool param_like;
  };
  const Item items[] = {{"dq", out.dq, ref.dq, false},
                        {"dk", out.dk, ref.dk, false},
                        {"dv", out.dv, ref.dv, false},
                        {"dh0", out.dh0, ref.dh0, false},
                        {"dg", out.dg, ref.dg, true},
                        {"dbeta", out.dbeta, ref.dbeta, true},
                        {"dA_log", out.dA_log, ref.dA_log, true},
                        {"ddt_bias", out.ddt_bias, ref.ddt_bias, true}};
  for (const Item& it : items) {
    const Metric m = compare(it.a, it.b);
    const double bound = grad_bound(c.dtype, it.param_like);
    if (std::getenv("KDA_TEST_VERBOSE")) std::printf("%s %s | %s\n", it.name, m.str().c_str(), c.describe().c_str());
    EXPECT_TRUE(m.finite && m.rel <= bound) << it.name << ": " << m.str() << " bound=" << bound << "\n"
                                            << c.describe() << (residuals == Residuals::kSaved ? " saved" : " remat");
  }
}

bool large_tests() {
  return std::getenv("KDA_LARGE_TESTS") != nullptr;
}

}  // namespace kda::test

// The decode cases shared by the CPU decode tests (test_decode.cpp) and the CUDA decode tests
// (test_cuda.cpp, test_cuda_emulation.cpp): a pool, slot maps, the fp64 oracle per row, and the
// check of an implementation against it (o, the pool, and bitwise untouched slots).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace kda::test {

struct DecodeCase {
  std::string name;
  Case c;  // B = N rows, T tokens per row
  std::int64_t slots = 8;
  std::vector<std::int64_t> idx;       // [N] or [N, T]
  std::vector<std::int64_t> accepted;  // [N] or empty
  DType pool_dtype = DType::kF32;      // bf16 / fp16: read converted, written rounded
};
inline void PrintTo(const DecodeCase& c, std::ostream* os) {
  *os << c.name;
}

// Every gate, dtype, layout and head shape, each as one token per row (a padding row among them)
// and as draft tokens with per-token slots and accepted counts.
inline std::vector<DecodeCase> decode_option_cases() {
  struct Opt {
    const char* name;
    DType dtype;
    Gate gate;
    bool l2norm, beta_sigmoid, neg_eig;
    StateLayout layout;
    std::int64_t H, HV, K, V;
  };
  const Opt opts[] = {
      {"logdecay_f32", DType::kF32, Gate::kLogDecay, true, false, false, StateLayout::kKFirst, 2, 2, 32, 32},
      {"softplus_grouped_vfirst", DType::kF32, Gate::kSoftplus, true, false, false, StateLayout::kVFirst, 2, 4, 48, 24},
      {"lowerbound_beta_sigmoid", DType::kF32, Gate::kLowerBound, true, true, true, StateLayout::kKFirst, 1, 2, 60,
       100},
      // V-first rows of 60 floats: the in-place kernel's partial-vector path (masked loads, last line).
      {"lowerbound_vfirst_k60", DType::kF32, Gate::kLowerBound, true, true, true, StateLayout::kVFirst, 1, 2, 60, 100},
      {"no_l2norm_bf16", DType::kBF16, Gate::kLogDecay, false, false, false, StateLayout::kVFirst, 1, 1, 128, 128},
      {"f16_softplus", DType::kF16, Gate::kSoftplus, true, true, false, StateLayout::kKFirst, 2, 2, 16, 64},
      {"k256_v256_bf16", DType::kBF16, Gate::kLowerBound, true, false, false, StateLayout::kKFirst, 1, 2, 256, 256},
      // An odd number of V-first rows: the draft-token groups' last row goes alone.
      {"softplus_vfirst_v33", DType::kF32, Gate::kSoftplus, true, false, false, StateLayout::kVFirst, 1, 1, 32, 33},
  };
  std::vector<DecodeCase> out;
  for (const Opt& o : opts) {
    DecodeCase one;
    one.c.B = 4, one.c.T = 1, one.c.H = o.H, one.c.HV = o.HV, one.c.K = o.K, one.c.V = o.V;
    one.c.dtype = o.dtype, one.c.gate = o.gate, one.c.l2norm = o.l2norm, one.c.beta_sigmoid = o.beta_sigmoid;
    one.c.neg_eigval = o.neg_eig, one.c.layout = o.layout;
    one.idx = {5, 0, -1, 2};  // row 2 is padding
    one.name = std::string(o.name) + "_single_token";
    out.push_back(one);
    DecodeCase draft = one;
    draft.c.B = 3, draft.c.T = 4;
    draft.slots = 16;
    draft.idx = {1, 2, 3, 4, 5, 6, -1, 7, 8, 9, 10, 11};  // row 1 keeps no state after token 2
    draft.accepted = {1, 2, 4};                           // row 1 reads slot 6, row 2 slot 11
    draft.name = std::string(o.name) + "_draft_tokens";
    out.push_back(draft);
    // Draft tokens with [N] indices: read the slot, write it back after the last token (in place
    // for K-first pools with V a multiple of 16, row groups in L1 for V-first ones).
    DecodeCase last = one;
    last.c.B = 3, last.c.T = 3;
    last.slots = 12;
    last.idx = {4, -1, 9};  // row 1 is padding
    last.name = std::string(o.name) + "_draft_tokens_row_slots";
    out.push_back(last);
    // One whole group of 4, and more draft tokens than one group: 4 + 4 + 1 and 4 + 2. (One group
    // on V-first rows of whole vectors: 16 rows at a time, v_first_group_block16, the rows left
    // over in pairs.)
    for (std::int64_t T : {4, 9, 6}) {
      DecodeCase many = last;
      many.c.T = T;
      many.name = std::string(o.name) + "_draft_tokens_row_slots_T" + std::to_string(T);
      out.push_back(many);
    }
  }
  return out;
}

// Cases of decode_option_cases() on bf16 and fp16 pools (the CPU backend's narrow pools): K-first
// and V-first, whole and partial vectors, one token, draft tokens with per-token slots, and draft
// tokens written back after the last.
inline std::vector<DecodeCase> decode_narrow_pool_cases() {
  std::vector<DecodeCase> out;
  for (const DecodeCase& dc : decode_option_cases()) {
    bool pick = false;
    for (const char* prefix : {"logdecay_f32_", "softplus_grouped_vfirst_", "lowerbound_beta_sigmoid_",
                               "softplus_vfirst_v33_", "no_l2norm_bf16_"})
      pick = pick || dc.name.rfind(prefix, 0) == 0;
    if (!pick) continue;
    for (DType pool : {DType::kBF16, DType::kF16}) {
      DecodeCase narrow = dc;
      narrow.pool_dtype = pool;
      narrow.name = dc.name + (pool == DType::kBF16 ? "_bf16_pool" : "_f16_pool");
      out.push_back(narrow);
    }
  }
  return out;
}

struct DecodeData {
  Inputs in;
  HostTensor pool;  // [slots, HV, K, V] or V-first
};

inline DecodeData make_decode_data(const DecodeCase& dc) {
  DecodeData d;
  d.in = make_inputs(dc.c);
  const Case& c = dc.c;
  d.pool = c.layout == StateLayout::kKFirst ? HostTensor(dc.pool_dtype, {dc.slots, c.HV, c.K, c.V})
                                            : HostTensor(dc.pool_dtype, {dc.slots, c.HV, c.V, c.K});
  std::mt19937 rng(c.seed + 5);
  std::normal_distribution<double> normal(0.0, 0.5);
  for (std::int64_t i = 0; i < d.pool.numel(); ++i) d.pool.set(i, normal(rng));
  return d;
}

inline DecodeParams make_decode_params(const DecodeCase& dc, DecodeData& d, HostTensor& o, HostTensor& idx,
                                       HostTensor& acc) {
  const Case& c = dc.c;
  HostTensor ht;
  ForwardParams f = make_params(c, d.in, o, ht);
  DecodeParams p;
  p.q = f.q, p.k = f.k, p.v = f.v, p.g = f.g, p.beta = f.beta, p.A_log = f.A_log, p.dt_bias = f.dt_bias;
  p.o = o.view;
  p.options = f.options;
  p.state_pool = d.pool.view;
  const bool per_token = static_cast<std::int64_t>(dc.idx.size()) == c.B * c.T && c.T > 1;
  idx = per_token ? HostTensor(DType::kI64, {c.B, c.T}) : HostTensor(DType::kI32, {c.B});
  for (std::size_t i = 0; i < dc.idx.size(); ++i) idx.set(static_cast<std::int64_t>(i), static_cast<double>(dc.idx[i]));
  p.slot_indices = idx.view;
  if (!dc.accepted.empty()) {
    acc = HostTensor(DType::kI32, {c.B});
    for (std::size_t i = 0; i < dc.accepted.size(); ++i)
      acc.set(static_cast<std::int64_t>(i), static_cast<double>(dc.accepted[i]));
    p.num_accepted_tokens = acc.view;
  }
  return p;
}

// The expected o [N, T, HV, V] and pool after the decode: the fp64 oracle on each row.
inline void oracle_decode(const DecodeCase& dc, const DecodeData& d, std::vector<double>* o_out,
                          std::vector<double>* pool_out) {
  const Case& c = dc.c;
  std::vector<double>& eo = *o_out;
  std::vector<double>& ep = *pool_out;
  eo.assign(static_cast<std::size_t>(c.B * c.T * c.HV * c.V), 0.0);
  ep = d.pool.to_double();
  const std::vector<double> pool0 = ep;
  const std::int64_t slot = c.HV * c.K * c.V;
  const bool per_token = static_cast<std::int64_t>(dc.idx.size()) == c.B * c.T && c.T > 1;
  const bool kf = c.layout == StateLayout::kKFirst;
  for (std::int64_t n = 0; n < c.B; ++n) {
    const std::int64_t first = dc.accepted.empty() ? 0 : dc.accepted[n] - 1;
    const std::int64_t read = per_token ? dc.idx[n * c.T + first] : dc.idx[n];
    if (read < 0) continue;
    Case one = c;  // one row as a fixed-length sequence; chunk 1: chunk_states[t] = state before token t
    one.B = 1;
    one.chunk = 1;
    one.initial_state = true;
    one.final_state = true;
    Inputs row = slice_sequence(c, d.in, n, 0, c.T, 0);
    row.h0 = kf ? HostTensor(DType::kF64, {1, c.HV, c.K, c.V}) : HostTensor(DType::kF64, {1, c.HV, c.V, c.K});
    for (std::int64_t i = 0; i < slot; ++i) row.h0.set(i, pool0[read * slot + i]);
    HostTensor o(DType::kF64, {1, c.T, c.HV, c.V});
    HostTensor ht = kf ? HostTensor(DType::kF64, {1, c.HV, c.K, c.V}) : HostTensor(DType::kF64, {1, c.HV, c.V, c.K});
    HostTensor states =
        kf ? HostTensor(DType::kF64, {c.T, c.HV, c.K, c.V}) : HostTensor(DType::kF64, {c.T, c.HV, c.V, c.K});
    ForwardParams f = make_params(one, row, o, ht);
    f.chunk_states = states.view;
    const Status s = reference_forward(f);
    EXPECT_TRUE(s.ok()) << s.message();
    for (std::int64_t i = 0; i < c.T * c.HV * c.V; ++i) eo[n * c.T * c.HV * c.V + i] = o.get(i);
    for (std::int64_t t = 0; t < c.T; ++t) {
      std::int64_t w = -1;
      if (per_token)
        w = dc.idx[n * c.T + t];
      else if (t == c.T - 1)
        w = read;
      if (w < 0) continue;
      for (std::int64_t i = 0; i < slot; ++i)
        ep[w * slot + i] = t + 1 < c.T ? states.get((t + 1) * slot + i) : ht.get(i);
    }
  }
}

using DecodeExec = std::function<Status(const DecodeParams&)>;

// Every element of a narrow (bf16 / fp16) pool within half a unit in the last place of the
// oracle's fp64 state (rounding to nearest), plus the fp32 computation's own error (SPEC.md's 1e-5, relative to the
// pool's largest element): the kernel rounds its fp32 state to nearest, which can differ from rounding the fp64 one
// only where the two straddle a rounding boundary, and elements that cancel to near zero carry the fp32 error of the
// state's scale, not of their own.
inline void expect_rounded_to_nearest(const std::vector<double>& after, const std::vector<double>& ref, DType dtype,
                                      const std::string& what) {
  const int bits = dtype == DType::kBF16 ? 8 : 11;  // significand bits, the implicit one included
  double scale = 0;
  for (double x : ref) scale = std::max(scale, std::fabs(x));
  for (std::size_t i = 0; i < ref.size(); ++i) {
    int e = 0;
    std::frexp(ref[i], &e);  // |ref| in [2^(e-1), 2^e): one ulp is 2^(e - bits)
    const double bound = std::ldexp(0.5, e - bits) + 1e-5 * scale;
    ASSERT_LE(std::fabs(after[i] - ref[i]), bound)
        << what << " pool element " << i << ": " << after[i] << " against the oracle's " << ref[i];
  }
}

// o and the pool of `exec` against the oracle; slots no row writes must stay bitwise unchanged.
inline void expect_decode_exec_matches_oracle(const DecodeCase& dc, const DecodeExec& exec, const std::string& what) {
  DecodeData d = make_decode_data(dc);
  std::vector<double> eo, ep;
  oracle_decode(dc, d, &eo, &ep);
  const std::vector<double> before = d.pool.to_double();
  HostTensor o(dc.c.dtype, {dc.c.B, dc.c.T, dc.c.HV, dc.c.V}), idx, acc;
  o.fill(12345.0);
  const DecodeParams p = make_decode_params(dc, d, o, idx, acc);
  const Status s = exec(p);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  const double bound = forward_bound(dc.c.dtype);
  const Metric mo = compare(o.to_double(), eo);
  EXPECT_TRUE(mo.finite && mo.rel <= bound) << what << " o: " << mo.str() << "\n" << dc.c.describe();
  const std::vector<double> after = d.pool.to_double();
  if (dc.pool_dtype == DType::kF32) {
    const Metric mp = compare(after, ep);
    EXPECT_TRUE(mp.finite && mp.rel <= 1e-5) << what << " pool: " << mp.str() << "\n" << dc.c.describe();
  } else {
    expect_rounded_to_nearest(after, ep, dc.pool_dtype, what);
  }
  const std::int64_t slot = dc.c.HV * dc.c.K * dc.c.V;
  for (std::int64_t s2 = 0; s2 < dc.slots; ++s2) {
    bool written = false;
    for (std::int64_t i = 0; i < slot; ++i)
      if (ep[s2 * slot + i] != before[s2 * slot + i]) written = true;
    if (written) continue;
    for (std::int64_t i = 0; i < slot; ++i)
      ASSERT_EQ(after[s2 * slot + i], before[s2 * slot + i]) << what << ": slot " << s2 << " is written by no row";
  }
}

}  // namespace kda::test

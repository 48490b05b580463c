// Cases and oracle checks shared by the CUDA tests (tests/cpp/test_cuda.cpp, on a GPU) and by the
// host emulation of the CUDA kernels (tests/cpp/test_cuda_emulation.cpp, everywhere): the CPU
// suite's conformance cases (test_forward_oracle.cpp, test_varlen.cpp, test_decode.cpp) run
// through an executor that takes host-side params, against the fp64 oracle with the SPEC.md
// section 4 bounds.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "decode_cases.hpp"
#include "forward_cases.hpp"
#include "test_util.hpp"

namespace kda::test {

struct NamedCase {
  std::string name;
  Case c;
};
inline void PrintTo(const NamedCase& c, std::ostream* os) {
  *os << c.name;
}

// The forward conformance cases: shapes x dtypes, every option, packed sequences, extreme gates.
inline std::vector<NamedCase> cuda_forward_cases() {
  std::vector<NamedCase> out;
  // Shapes (test_forward_oracle.cpp ShapeMatrix), fp32 with initial states and bf16 with the gate in kernel.
  const std::int64_t Ts[] = {1, 15, 64, 65, 1000};
  const std::pair<std::int64_t, std::int64_t> KVs[] = {{64, 64}, {60, 100}, {128, 128}, {256, 64}};
  const std::pair<std::int64_t, std::int64_t> Hs[] = {{1, 1}, {3, 3}, {2, 4}, {2, 8}};
  int cycle = 0;
  for (auto T : Ts)
    for (auto kv : KVs) {
      auto hh = Hs[cycle++ % 4];
      if (T == 1000 && hh.second > 4) hh = {1, 1};
      Case c;
      c.T = T, c.K = kv.first, c.V = kv.second, c.H = hh.first, c.HV = hh.second;
      c.initial_state = true;
      c.seed = static_cast<std::uint32_t>(T * 131 + c.K * 7 + c.V + c.HV);
      const std::string shape = "T" + std::to_string(T) + "_K" + std::to_string(c.K) + "_V" + std::to_string(c.V) +
                                "_H" + std::to_string(c.H) + "_HV" + std::to_string(c.HV);
      out.push_back({"shape_" + shape + "_f32", c});
      Case b = c;
      b.dtype = DType::kBF16;
      b.gate = Gate::kLowerBound;
      b.initial_state = false;
      b.seed = 1;
      out.push_back({"shape_" + shape + "_bf16", b});
    }
  // Options (forward_cases.hpp, test_forward_oracle.cpp OptionMatrix) in every dtype.
  for (const OptionCase& o : option_cases())
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
      out.push_back({std::string("option_") + o.name + "_" + dtype_name(dt), option_case(o, dt)});
  // Packed sequences (test_varlen.cpp): cu_seqlens with boundaries anywhere and empty segments.
  const std::pair<const char*, std::vector<std::int64_t>> cus[] = {
      {"single_15", {0, 15}},
      {"three_unaligned", {0, 256, 500, 1000}},
      {"five_mixed", {0, 15, 100, 300, 1200, 2000}},
      {"lengths_1_to_8", {0, 1, 3, 6, 10, 15, 21, 28, 36}},
      {"empty_segments", {0, 0, 10, 10, 75, 75, 140}},
      {"all_empty_but_one", {0, 0, 0, 33, 33}},
  };
  for (const auto& cu : cus)
    for (DType dt : {DType::kF32, DType::kBF16}) {
      Case c;
      c.cu_seqlens = cu.second;
      c.T = cu.second.back();
      c.H = 1, c.HV = 2, c.K = 32, c.V = 48;
      c.dtype = dt;
      c.initial_state = true;
      c.gate = Gate::kSoftplus;
      out.push_back({std::string("cu_seqlens_") + cu.first + "_" + dtype_name(dt), c});
    }
  {
    Case c;  // segment_ids with trailing padding and unused slots
    c.segment_ids = id_runs({50, 70, 30}, 50);
    c.T = 200, c.max_num_segments = 5, c.H = 2, c.HV = 2, c.K = 32, c.V = 32;
    c.initial_state = true;
    out.push_back({"segment_ids_padding_unused_slots", c});
  }
  {
    Case c;  // [B, T] segment_ids, rows segmented differently
    c.B = 2, c.T = 130;
    c.segment_ids = id_runs({7, 1, 64, 58}, 0);
    const auto row2 = id_runs({100}, 30);
    c.segment_ids.insert(c.segment_ids.end(), row2.begin(), row2.end());
    c.max_num_segments = 4, c.H = 1, c.HV = 3, c.K = 16, c.V = 24;
    c.initial_state = true;
    c.gate = Gate::kLowerBound;
    out.push_back({"segment_ids_batch_rows", c});
  }
  {
    Case c;  // [T] map broadcast over the batch, fp16
    c.B = 3, c.T = 90;
    c.segment_ids = id_runs({17, 40, 20}, 13);
    c.max_num_segments = 3, c.H = 1, c.HV = 1, c.K = 24, c.V = 40;
    c.dtype = DType::kF16;
    out.push_back({"segment_ids_broadcast_f16", c});
  }
  // Extreme gates: g = -1000 on half the entries, 0 elsewhere (the pairwise path of the
  // intra-chunk products), every kernel family.
  for (auto kv : {std::pair<std::int64_t, std::int64_t>{64, 64}, {128, 128}, {200, 72}}) {
    Case c;
    c.T = 200, c.H = 1, c.HV = 2, c.K = kv.first, c.V = kv.second;
    c.extreme_gates = true;
    c.initial_state = true;
    out.push_back({"extreme_gates_K" + std::to_string(c.K) + "_V" + std::to_string(c.V), c});
  }
  {
    Case c;  // SPEC.md section 5 small shape, packed with four non-64-aligned segments, bf16
    c.cu_seqlens = {0, 100, 333, 700, 1024};
    c.T = 1024, c.H = 8, c.HV = 8, c.K = 128, c.V = 128;
    c.dtype = DType::kBF16;
    c.gate = Gate::kLowerBound;
    c.initial_state = true;
    out.push_back({"small_packed_bf16", c});
  }
  return out;
}

// Runs a forward executor on host-side params (its job: compute them, results in the host
// outputs). Returns o, the final state and the chunk states as doubles.
using ForwardExec = std::function<Status(const ForwardParams&)>;

struct ExecResult {
  std::vector<double> o, ht, cs;
};

inline ExecResult run_forward_exec(const Case& c, const Inputs& in, const ForwardExec& exec, bool oracle,
                                   bool chunk_states) {
  const DType out_dtype = oracle ? DType::kF64 : c.dtype;
  const DType state_dtype = oracle ? DType::kF64 : DType::kF32;
  const std::int64_t n = c.num_states();
  const bool kf = c.layout == StateLayout::kKFirst;
  HostTensor o(out_dtype, {c.B, c.T, c.HV, c.V});
  o.fill(12345.0);  // every element must be written
  HostTensor ht = kf ? HostTensor(state_dtype, {n, c.HV, c.K, c.V}) : HostTensor(state_dtype, {n, c.HV, c.V, c.K});
  ht.fill(12345.0);
  ForwardParams p = make_params(c, in, o, ht);
  HostTensor cs;
  if (chunk_states) {
    std::int64_t nc = 0;
    const Status s = forward_chunk_count(p, &nc);
    EXPECT_TRUE(s.ok()) << s.message();
    cs = kf ? HostTensor(state_dtype, {nc, c.HV, c.K, c.V}) : HostTensor(state_dtype, {nc, c.HV, c.V, c.K});
    cs.fill(12345.0);
    p.chunk_states = cs.view;
  }
  const Status s = oracle ? reference_forward(p) : exec(p);
  EXPECT_TRUE(s.ok()) << s.message() << "\n" << c.describe();
  ExecResult r;
  r.o = o.to_double();
  if (c.final_state) r.ht = ht.to_double();
  if (chunk_states) r.cs = cs.to_double();
  return r;
}

// o, the final state and the chunk states of `exec` against the fp64 oracle (SPEC.md section 4).
inline void expect_exec_matches_oracle(const Case& c, const ForwardExec& exec, const std::string& what) {
  const Inputs in = make_inputs(c);
  const ExecResult ref = run_forward_exec(c, in, exec, true, true);
  const ExecResult out = run_forward_exec(c, in, exec, false, true);
  const double bound = forward_bound(c.dtype);
  const Metric mo = compare(out.o, ref.o);
  EXPECT_TRUE(mo.finite && mo.rel <= bound) << what << " o: " << mo.str() << " bound=" << bound << "\n" << c.describe();
  if (c.final_state) {
    const Metric mh = compare(out.ht, ref.ht);
    EXPECT_TRUE(mh.finite && mh.rel <= bound) << what << " final_state: " << mh.str() << " bound=" << bound << "\n"
                                              << c.describe();
  }
  const Metric mc = compare(out.cs, ref.cs);
  EXPECT_TRUE(mc.finite && mc.rel <= bound) << what << " chunk_states: " << mc.str() << " bound=" << bound << "\n"
                                            << c.describe();
}

}  // namespace kda::test

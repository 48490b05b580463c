// Invalid input gets a clear error naming the argument, the expected and the actual value, and
// nothing is written (SPEC.md, developers' guide). Each row breaks one thing of a valid call.
#include <functional>

#include "test_util.hpp"

namespace kda::test {
namespace {

struct ErrorCase {
  const char* name;
  std::function<void(ForwardParams&, Inputs&)> breaks;
  std::vector<std::string> message_has;  // substrings the message must contain
  bool varlen = false;                   // start from a cu_seqlens call
  bool ids = false;                      // start from a segment_ids call
  bool oracle_accepts = false;           // valid for the fp64 oracle (execution options, fp64)
};

void PrintTo(const ErrorCase& e, std::ostream* os) {
  *os << e.name;
}

std::vector<ErrorCase> error_cases() {
  return {
      {"q_rank", [](ForwardParams& p, Inputs&) { p.q.ndim = 3; }, {"'q'", "4 dims", "[1, 20, 2]"}},
      {"k_shape", [](ForwardParams& p, Inputs&) { p.k.shape[3] = 17; }, {"'k'", "[1, 20, 2, 16]", "[1, 20, 2, 17]"}},
      {"v_heads_not_multiple",
       [](ForwardParams& p, Inputs&) {
         p.v.shape[2] = 3;
         p.o.shape[2] = 3;
       },
       {"'v'", "multiple of H = 2", "HV = 3"}},
      {"g_shape", [](ForwardParams& p, Inputs&) { p.g.shape[1] = 19; }, {"'g'", "[1, 20, 4, 16]", "[1, 19, 4, 16]"}},
      {"beta_shape",
       [](ForwardParams& p, Inputs&) {
         p.beta.ndim = 4;
         p.beta.shape[3] = 1;
       },
       {"'beta'", "[B, T, HV]"}},
      {"o_shape", [](ForwardParams& p, Inputs&) { p.o.shape[3] = 8; }, {"'o'", "[1, 20, 4, 24]", "[1, 20, 4, 8]"}},
      {"q_dtype_int",
       [](ForwardParams& p, Inputs&) { p.q.dtype = DType::kI32; },
       {"'q'", "float32, bfloat16 or float16", "int32"}},
      {"q_dtype_f64",
       [](ForwardParams& p, Inputs&) { p.q.dtype = DType::kF64; },
       {"'q'", "float64"},
       false,
       false,
       true},
      {"o_dtype",
       [](ForwardParams& p, Inputs&) { p.o.dtype = DType::kBF16; },
       {"'o'", "dtype of q (float32)", "bfloat16"},
       false,
       false,
       true},
      {"o_broadcast", [](ForwardParams& p, Inputs&) { p.o.strides[1] = 0; }, {"'o'", "zero (broadcast) stride"}},
      {"o_overlapping_rows",  // [1, 20, 4, 24]: consecutive tokens' rows share 48 of their 96 floats
       [](ForwardParams& p, Inputs&) { p.o.strides[1] = 48; },
       {"'o'", "overlap in memory", "strides [1920, 48, 24, 1]"}},
      {"null_data", [](ForwardParams& p, Inputs&) { p.v.data = nullptr; }, {"'v'", "null"}},
      {"chunk_size",
       [](ForwardParams& p, Inputs&) { p.options.chunk_size = 48; },
       {"chunk_size", "64, 32 or 16", "48"},
       false,
       false,
       true},
      {"threads", [](ForwardParams& p, Inputs&) { p.options.num_threads = -2; }, {"num_threads", "-2"}},
      {"scale_inf", [](ForwardParams& p, Inputs&) { p.options.scale = INFINITY; }, {"scale", "finite"}},
      // finite as a double, infinite as the kernels' float
      {"scale_beyond_float", [](ForwardParams& p, Inputs&) { p.options.scale = 1e39; }, {"scale", "float range"}},
      {"lower_bound_beyond_float",
       [](ForwardParams& p, Inputs&) {
         p.options.use_gate_in_kernel = true;
         p.options.has_lower_bound = true;
         p.options.lower_bound = -1e39;
       },
       {"lower_bound", "float range"}},
      {"lower_bound_zero_as_float",  // < 0 as a double, -0 as a float
       [](ForwardParams& p, Inputs&) {
         p.options.use_gate_in_kernel = true;
         p.options.has_lower_bound = true;
         p.options.lower_bound = -1e-50;
       },
       {"lower_bound", "< 0"}},
      {"lower_bound_positive",
       [](ForwardParams& p, Inputs&) {
         p.options.use_gate_in_kernel = true;
         p.options.has_lower_bound = true;
         p.options.lower_bound = 0.5f;
       },
       {"lower_bound", "< 0", "0.5"}},
      {"lower_bound_without_gate",
       [](ForwardParams& p, Inputs&) {
         p.options.has_lower_bound = true;
         p.options.lower_bound = -5;
       },
       {"lower_bound", "use_gate_in_kernel=false"}},
      {"softplus_needs_A_log",
       [](ForwardParams& p, Inputs&) { p.options.use_gate_in_kernel = true; },
       {"'A_log'", "required"}},
      {"A_log_without_gate",
       [](ForwardParams& p, Inputs& in) {
         in.A_log = HostTensor(DType::kF32, {4});
         p.A_log = in.A_log.view;
       },
       {"'A_log'", "use_gate_in_kernel=false"}},
      {"A_log_shape",
       [](ForwardParams& p, Inputs& in) {
         p.options.use_gate_in_kernel = true;
         in.A_log = HostTensor(DType::kF32, {3});
         p.A_log = in.A_log.view;
       },
       {"'A_log'", "[4]", "[3]"}},
      {"dt_bias_shape",
       [](ForwardParams& p, Inputs& in) {
         p.options.use_gate_in_kernel = true;
         in.A_log = HostTensor(DType::kF32, {4});
         p.A_log = in.A_log.view;
         in.dt_bias = HostTensor(DType::kF32, {4, 15});
         p.dt_bias = in.dt_bias.view;
       },
       {"'dt_bias'", "[HV * K] = [64]", "[4, 15]"}},
      {"neg_eigval_without_sigmoid",
       [](ForwardParams& p, Inputs&) { p.options.allow_neg_eigval = true; },
       {"allow_neg_eigval", "use_beta_sigmoid_in_kernel"}},
      {"initial_state_shape",
       [](ForwardParams& p, Inputs& in) {
         in.h0 = HostTensor(DType::kF32, {1, 4, 24, 16});
         p.initial_state = in.h0.view;
       },
       {"'initial_state'", "[1, 4, 16, 24]", "[1, 4, 24, 16]"}},
      {"final_state_dtype",
       [](ForwardParams& p, Inputs& in) {
         in.h0 = HostTensor(DType::kBF16, {1, 4, 16, 24});
         p.final_state = in.h0.view;
       },
       {"'final_state'", "float32", "bfloat16"}},
      {"v_new_shape",
       [](ForwardParams& p, Inputs& in) {
         in.h0 = HostTensor(DType::kF32, {1, 20, 4, 16});
         p.v_new = in.h0.view;
       },
       {"'v_new'", "[1, 20, 4, 24]", "[1, 20, 4, 16]"}},
      {"v_new_dtype",
       [](ForwardParams& p, Inputs& in) {
         in.h0 = HostTensor(DType::kBF16, {1, 20, 4, 24});
         p.v_new = in.h0.view;
       },
       {"'v_new'", "float32", "bfloat16"}},
      {"v_new_broadcast",
       [](ForwardParams& p, Inputs& in) {
         in.h0 = HostTensor(DType::kF32, {1, 20, 4, 24});
         p.v_new = in.h0.view;
         p.v_new.strides[1] = 0;
       },
       {"'v_new'", "zero (broadcast) stride"}},
      {"vfirst_state_shape",
       [](ForwardParams& p, Inputs&) { p.options.state_layout = StateLayout::kVFirst; },
       {"'final_state'", "[B, HV, V, K]", "[1, 4, 24, 16]"}},
      {"both_sequence_descriptions",
       [](ForwardParams& p, Inputs& in) {
         in.ids = HostTensor(DType::kI32, {20});
         p.segment_ids = in.ids.view;
         p.max_num_segments = 1;
       },
       {"cu_seqlens", "segment_ids", "both"},
       true},
      {"cu_not_monotonic",
       [](ForwardParams&, Inputs& in) {
         in.cu.set(1, 12);
         in.cu.set(2, 7);
       },
       {"'cu_seqlens'", "non-decreasing", "cu_seqlens[1] = 12 > cu_seqlens[2] = 7"},
       true},
      {"cu_not_starting_at_zero",
       [](ForwardParams&, Inputs& in) { in.cu.set(0, 1); },
       {"'cu_seqlens'", "= 0", "got 1"},
       true},
      {"cu_past_the_tokens",
       [](ForwardParams&, Inputs& in) { in.cu.set(3, 21); },
       {"'cu_seqlens'", "<= the total tokens T = 20", "got 21"},
       true},
      {"cu_dtype",
       [](ForwardParams& p, Inputs&) { p.cu_seqlens.dtype = DType::kF32; },
       {"'cu_seqlens'", "int32 or int64", "float32"},
       true},
      {"cu_with_batch",
       [](ForwardParams& p, Inputs&) {
         for (TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.o}) {
           t->shape[0] = 2;
           t->shape[1] = 10;
           t->strides[0] = t->strides[1] * 10;
         }
       },
       {"'cu_seqlens'", "B = 1", "B = 2"},
       true},
      {"ids_out_of_order",
       [](ForwardParams& p, Inputs& in) {
         in.ids.set(12, 3);
         in.ids.set(13, 3);
         p.max_num_segments = 3;
       },
       {"'segment_ids'", "expected id 2", "got 3"},
       false,
       true},
      {"ids_run_resumed_after_padding",
       [](ForwardParams&, Inputs& in) {
         in.ids.set(12, 0);
         in.ids.set(13, 1);
       },
       {"'segment_ids'", "expected id 2", "got 1"},
       false,
       true},
      {"ids_above_max",
       [](ForwardParams& p, Inputs&) { p.max_num_segments = 1; },
       {"'segment_ids'", "max_num_segments = 1", "got 2"},
       false,
       true},
      {"ids_negative", [](ForwardParams&, Inputs& in) { in.ids.set(0, -1); }, {"'segment_ids'", "got -1"}, false, true},
      {"ids_max_missing",
       [](ForwardParams& p, Inputs&) { p.max_num_segments = 0; },
       {"'max_num_segments'", ">= 1", "got 0"},
       false,
       true},
      {"ids_dtype",
       [](ForwardParams& p, Inputs&) { p.segment_ids.dtype = DType::kI64; },
       {"'segment_ids'", "int32", "int64"},
       false,
       true},
      {"ids_shape",
       [](ForwardParams& p, Inputs&) { p.segment_ids.shape[0] = 19; },
       {"'segment_ids'", "[T] = [20]", "[19]"},
       false,
       true},
      {"max_segments_without_ids",
       [](ForwardParams& p, Inputs&) { p.max_num_segments = 3; },
       {"'max_num_segments'", "segment_ids", "3"}},
  };
}

class Errors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(Errors, NamesArgumentAndWritesNothing) {
  const ErrorCase& ec = GetParam();
  Case c;
  c.T = 20, c.H = 2, c.HV = 4, c.K = 16, c.V = 24;
  if (ec.varlen) c.cu_seqlens = {0, 7, 12, 20};
  if (ec.ids) {
    c.segment_ids.assign(12, 1);
    c.segment_ids.resize(20, 2);
    c.max_num_segments = 2;
  }
  Inputs in = make_inputs(c);
  const std::int64_t n = c.num_states();
  HostTensor o(DType::kF32, {c.B, c.T, c.HV, c.V});
  HostTensor ht(DType::kF32, {n, c.HV, c.K, c.V});
  ForwardParams p = make_params(c, in, o, ht);
  for (Path path : {Path::kFused, Path::kStaged}) {
    o.fill(7.0);
    ht.fill(7.0);
    ForwardParams bad = p;
    bad.options.path = path;
    Inputs broken = in;
    // Re-point views at the copies so the break can edit their contents.
    bad.q.data = broken.q.bytes.data();
    if (ec.varlen) bad.cu_seqlens.data = broken.cu.bytes.data();
    if (ec.ids) bad.segment_ids.data = broken.ids.bytes.data();
    ec.breaks(bad, broken);
    const Status s = chunk_forward(bad);
    ASSERT_FALSE(s.ok()) << ec.name << " was accepted";
    for (const auto& sub : ec.message_has) {
      EXPECT_NE(s.message().find(sub), std::string::npos) << "message lacks '" << sub << "': " << s.message();
    }
    for (double x : o.to_double()) ASSERT_EQ(x, 7.0) << "o was written on error: " << s.message();
    for (double x : ht.to_double()) ASSERT_EQ(x, 7.0) << "final_state was written on error";
    // (Cases the oracle accepts are not run through it: their data does not match the params.)
    if (!ec.oracle_accepts) EXPECT_FALSE(reference_forward(bad).ok()) << "the oracle accepted " << ec.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Forward, Errors, ::testing::ValuesIn(error_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ErrorsOracle, AcceptsFloat64ButKernelsDoNot) {
  Case c;
  c.T = 5, c.H = 1, c.HV = 1, c.K = 4, c.V = 4;
  c.dtype = DType::kF64;
  Inputs in = make_inputs(c);
  HostTensor o(DType::kF64, {1, 5, 1, 4}), ht(DType::kF64, {1, 1, 4, 4});
  ForwardParams p = make_params(c, in, o, ht);
  EXPECT_TRUE(reference_forward(p).ok());
  EXPECT_FALSE(chunk_forward(p).ok());
}

}  // namespace
}  // namespace kda::test

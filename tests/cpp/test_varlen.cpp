// Packed sequences (SPEC.md 1.2) against the fp64 oracle: cu_seqlens with boundaries anywhere,
// several segments per chunk, empty segments; segment_ids with trailing padding, [B, T] and
// broadcast [T] maps, unused slots up to max_num_segments.
#include "test_util.hpp"

namespace kda::test {
namespace {

struct VarlenCase {
  const char* name;
  std::vector<std::int64_t> cu;
};

const VarlenCase kCuCases[] = {
    {"single_15", {0, 15}},
    {"three_unaligned", {0, 256, 500, 1000}},
    {"five_mixed", {0, 15, 100, 300, 1200, 2000}},
    {"lengths_1_to_8", {0, 1, 3, 6, 10, 15, 21, 28, 36}},
    {"empty_segments", {0, 0, 10, 10, 75, 75, 140}},
    {"all_empty_but_one", {0, 0, 0, 33, 33}},
};

class CuSeqlens : public ::testing::TestWithParam<std::tuple<VarlenCase, DType, Path>> {};

TEST_P(CuSeqlens, MatchesOracle) {
  const auto [vc, dtype, path] = GetParam();
  Case c;
  c.cu_seqlens = vc.cu;
  c.T = vc.cu.back();
  c.H = 1, c.HV = 2, c.K = 32, c.V = 48;
  c.dtype = dtype, c.path = path;
  c.initial_state = true;
  c.gate = Gate::kSoftplus;
  expect_matches_oracle(c);
}

INSTANTIATE_TEST_SUITE_P(Varlen, CuSeqlens,
                         ::testing::Combine(::testing::ValuesIn(kCuCases), ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(Path::kFused, Path::kStaged)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param)) + "_" + path_name(std::get<2>(info.param));
                         });

// cu_seqlens ending before T (FLA's graph mode packs into a fixed-size buffer): the tokens after it
// are padding, o exactly 0 there, and the oracle agrees on the rest.
class CuSeqlensTrailingPadding : public ::testing::TestWithParam<std::tuple<DType, Path>> {};

TEST_P(CuSeqlensTrailingPadding, MatchesOracle) {
  const auto [dtype, path] = GetParam();
  Case c;
  c.cu_seqlens = {0, 40, 40, 131};
  c.T = 160;
  c.H = 1, c.HV = 2, c.K = 32, c.V = 48;
  c.dtype = dtype, c.path = path;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  expect_matches_oracle(c);
}

INSTANTIATE_TEST_SUITE_P(Varlen, CuSeqlensTrailingPadding,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(Path::kFused, Path::kStaged)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_" +
                                  path_name(std::get<1>(info.param));
                         });

class SegmentIds : public ::testing::TestWithParam<Path> {};

TEST_P(SegmentIds, TrailingPaddingAndUnusedSlots) {
  Case c;
  c.segment_ids = id_runs({50, 70, 30}, 50);
  c.T = 200;
  c.max_num_segments = 5;  // slots 4 and 5 are empty
  c.H = 2, c.HV = 2, c.K = 32, c.V = 32;
  c.initial_state = true;
  c.path = GetParam();
  expect_matches_oracle(c);
}

TEST_P(SegmentIds, BatchRowsWithDifferentSegmentation) {
  Case c;
  c.B = 2;
  c.T = 130;
  c.segment_ids = id_runs({7, 1, 64, 58}, 0);
  const auto row2 = id_runs({100}, 30);
  c.segment_ids.insert(c.segment_ids.end(), row2.begin(), row2.end());
  c.max_num_segments = 4;
  c.H = 1, c.HV = 3, c.K = 16, c.V = 24;
  c.initial_state = true;
  c.gate = Gate::kLowerBound;
  c.path = GetParam();
  expect_matches_oracle(c);
}

TEST_P(SegmentIds, BroadcastMapOverBatch) {
  Case c;
  c.B = 3;
  c.T = 90;
  c.segment_ids = id_runs({17, 40, 20}, 13);  // [T], shared by all rows
  c.max_num_segments = 3;
  c.H = 1, c.HV = 1, c.K = 24, c.V = 40;
  c.dtype = DType::kF16;
  c.path = GetParam();
  expect_matches_oracle(c);
}

TEST_P(SegmentIds, PaddingOnlyRow) {
  Case c;
  c.B = 2;
  c.T = 20;
  c.segment_ids = id_runs({20}, 0);
  const auto row2 = id_runs({}, 20);
  c.segment_ids.insert(c.segment_ids.end(), row2.begin(), row2.end());
  c.max_num_segments = 2;
  c.H = 1, c.HV = 1, c.K = 16, c.V = 16;
  c.initial_state = true;
  c.path = GetParam();
  expect_matches_oracle(c);
}

INSTANTIATE_TEST_SUITE_P(Varlen, SegmentIds, ::testing::Values(Path::kFused, Path::kStaged),
                         [](const auto& info) { return std::string(path_name(info.param)); });

}  // namespace
}  // namespace kda::test

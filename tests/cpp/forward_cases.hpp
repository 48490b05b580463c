// The forward's option cases, shared by the CPU oracle tests (test_forward_oracle.cpp) and the
// CUDA tests (cuda_cases.hpp): every gate mode, the input transforms, both state layouts, the
// chunk sizes, with and without states, on a shape with a partial last chunk and grouped heads.
#pragma once

#include <vector>

#include "test_util.hpp"

namespace kda::test {

struct OptionCase {
  const char* name;
  Gate gate;
  bool l2norm, beta_sigmoid, neg_eig, h0, ht;
  StateLayout layout;
  int chunk;
};

inline const std::vector<OptionCase>& option_cases() {
  static const std::vector<OptionCase> cases = {
      {"logdecay", Gate::kLogDecay, true, false, false, false, true, StateLayout::kKFirst, 64},
      {"softplus", Gate::kSoftplus, true, false, false, true, true, StateLayout::kKFirst, 64},
      {"lowerbound", Gate::kLowerBound, true, false, false, true, true, StateLayout::kKFirst, 64},
      {"no_l2norm", Gate::kLogDecay, false, false, false, true, true, StateLayout::kKFirst, 64},
      {"beta_sigmoid", Gate::kSoftplus, true, true, false, false, true, StateLayout::kKFirst, 64},
      {"neg_eigval", Gate::kLowerBound, true, true, true, true, true, StateLayout::kKFirst, 64},
      {"vfirst", Gate::kLogDecay, true, false, false, true, true, StateLayout::kVFirst, 64},
      {"no_states", Gate::kLogDecay, true, false, false, false, false, StateLayout::kKFirst, 64},
      {"chunk32", Gate::kSoftplus, true, false, false, true, true, StateLayout::kKFirst, 32},
      {"chunk16", Gate::kLowerBound, false, true, false, true, true, StateLayout::kVFirst, 16},
  };
  return cases;
}

// T = 150 (a partial last chunk), H = 2 q/k heads for HV = 4 value heads, K = 60, V = 100.
inline Case option_case(const OptionCase& oc, DType dtype) {
  Case c;
  c.T = 150, c.H = 2, c.HV = 4, c.K = 60, c.V = 100;
  c.dtype = dtype;
  c.gate = oc.gate, c.l2norm = oc.l2norm, c.beta_sigmoid = oc.beta_sigmoid, c.neg_eigval = oc.neg_eig;
  c.initial_state = oc.h0, c.final_state = oc.ht, c.layout = oc.layout, c.chunk = oc.chunk;
  c.seed = 7;
  return c;
}

}  // namespace kda::test

// Strided, non-owning tensor views: a data pointer, a dtype, a shape and element strides.
// Any permutation of dimensions (batch-first or head-first, SPEC.md 1.1) is a stride choice,
// so no layout ever needs a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace kda {

enum class DType : std::uint8_t { kF32, kBF16, kF16, kF64, kI32, kI64 };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

inline constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = -1;  // -1: not given (optional argument absent)
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};  // in elements, not bytes

  bool defined() const { return ndim >= 0; }
  std::int64_t numel() const;
  // "[2, 3, 4]"
  std::string shape_str() const;

  // Row-major view of `data` with the given shape.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape);
  // The same view with dimensions reordered: result dim i = this dim perm[i].
  TensorView permuted(std::initializer_list<int> perm) const;
};

}  // namespace kda

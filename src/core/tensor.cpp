#include <sstream>

#include "kda/kda.hpp"

namespace kda {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF64:
      return "float64";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kF64:
      return 8;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 0;
}

const char* path_name(Path path) {
  switch (path) {
    case Path::kFused:
      return "fused";
    case Path::kStaged:
      return "staged";
  }
  return "unknown";
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

TensorView TensorView::permuted(std::initializer_list<int> perm) const {
  TensorView t = *this;
  int i = 0;
  for (int p : perm) {
    t.shape[i] = shape[p];
    t.strides[i] = strides[p];
    ++i;
  }
  return t;
}

const char* version() {
  return KDA_VERSION_STRING;
}

}  // namespace kda

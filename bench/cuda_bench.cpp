// kda-cuda-bench: GPU latency of the SPEC.md section 5 workloads through the public API with
// device tensors: the representative training shape (fixed and packed N = 25), the small and
// inference shapes, and decode batches against a state pool. Median over repeated runs timed
// with CUDA events after warm-up, the L2 flushed before each run (outside the timed region);
// peak device memory from the library's accounting allocator (include/kda/cuda.hpp); the
// device-to-device copy bandwidth measured in the same run as the ceiling for decode.
//
//   kda-cuda-bench [--json PATH] [--reps N] [--quick]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kda/cuda.hpp"
#include "kda/kda.hpp"

namespace {

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

std::uint64_t g_rng = 0x9e3779b97f4a7c15ull;
double uniform() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return static_cast<double>(g_rng >> 11) * 0x1.0p-53;
}
double normal() {
  const double u = std::max(uniform(), 1e-300), v = uniform();
  return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
}

std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// A device tensor from the accounting allocator, filled from the host.
struct DevTensor {
  void* ptr = nullptr;
  kda::TensorView view;
  DevTensor() = default;
  DevTensor(kda::DType dtype, std::initializer_list<std::int64_t> shape, double (*gen)() = nullptr) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    const std::size_t bytes = static_cast<std::size_t>(n) * kda::dtype_size(dtype);
    ptr = kda::cuda_allocate(bytes);
    if (ptr == nullptr) {
      std::fprintf(stderr, "cuda_allocate(%zu) failed\n", bytes);
      std::exit(2);
    }
    view = kda::TensorView::contiguous(ptr, dtype, shape);
    std::vector<unsigned char> host(bytes, 0);
    if (gen != nullptr) {
      for (std::int64_t i = 0; i < n; ++i) {
        const float x = static_cast<float>(gen());
        if (dtype == kda::DType::kBF16) {
          const std::uint16_t b = to_bf16(x);
          std::memcpy(host.data() + 2 * i, &b, 2);
        } else {
          std::memcpy(host.data() + 4 * i, &x, 4);
        }
      }
    }
    CHECK_CUDA(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  ~DevTensor() { kda::cuda_deallocate(ptr); }
};

double gen_normal() {
  return normal();
}
double gen_beta() {
  return 1.0 / (1.0 + std::exp(-normal()));
}
double gen_alog() {
  return std::log(1.0 + 15.0 * uniform()) - 2.0;
}
double gen_bias() {
  return 0.5 * normal();
}

struct Timing {
  double median_ms = 0, min_ms = 0;
  std::int64_t peak_bytes = 0, temp_bytes = 0;
};

void* g_flush = nullptr;
std::size_t g_flush_bytes = 0;

template <typename F>
Timing time_call(F&& call, int warmup, int reps) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) call();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms;
  Timing t;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaMemsetAsync(g_flush, r & 0xff, g_flush_bytes));  // evict the L2
    const kda::MemoryStats before = kda::cuda_memory_stats();
    kda::cuda_reset_peak_memory();
    CHECK_CUDA(cudaEventRecord(start));
    call();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float e = 0;
    CHECK_CUDA(cudaEventElapsedTime(&e, start, stop));
    ms.push_back(e);
    const kda::MemoryStats after = kda::cuda_memory_stats();
    t.peak_bytes = after.peak_bytes;
    t.temp_bytes = after.peak_bytes - before.current_bytes;
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  t.median_ms = ms[ms.size() / 2];
  t.min_ms = ms.front();
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return t;
}

FILE* g_json = nullptr;

void report(const std::string& name, const std::string& shape, const Timing& t, const std::string& extra) {
  std::printf("%-22s %-52s median %9.3f ms  min %9.3f ms  peak %8.1f MiB (library temporaries %.3f MiB)  %s\n",
              name.c_str(), shape.c_str(), t.median_ms, t.min_ms, t.peak_bytes / 1048576.0, t.temp_bytes / 1048576.0,
              extra.c_str());
  std::fflush(stdout);
  if (g_json) {
    std::fprintf(g_json,
                 "{\"name\": \"%s\", \"shape\": \"%s\", \"median_ms\": %.6f, \"min_ms\": %.6f, \"peak_bytes\": %lld, "
                 "\"temp_bytes\": %lld, \"extra\": \"%s\"}\n",
                 name.c_str(), shape.c_str(), t.median_ms, t.min_ms, static_cast<long long>(t.peak_bytes),
                 static_cast<long long>(t.temp_bytes), extra.c_str());
    std::fflush(g_json);
  }
}

void fail_if(const kda::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.message().c_str());
    std::exit(3);
  }
}

// Forward of SPEC.md section 5: raw gate in kernel with lower_bound = -5, qk l2norm in kernel.
void bench_forward(const std::string& name, std::int64_t H, std::int64_t T, const std::vector<std::int64_t>& cu,
                   bool cu_on_device, int warmup, int reps) {
  const std::int64_t K = 128, V = 128, HV = H;
  const std::int64_t N = cu.empty() ? 1 : static_cast<std::int64_t>(cu.size()) - 1;
  DevTensor q(kda::DType::kBF16, {1, T, H, K}, gen_normal), k(kda::DType::kBF16, {1, T, H, K}, gen_normal);
  DevTensor v(kda::DType::kBF16, {1, T, HV, V}, gen_normal), g(kda::DType::kBF16, {1, T, HV, K}, gen_normal);
  DevTensor beta(kda::DType::kBF16, {1, T, HV}, gen_beta), A_log(kda::DType::kF32, {HV}, gen_alog);
  DevTensor dt_bias(kda::DType::kF32, {HV * K}, gen_bias), o(kda::DType::kBF16, {1, T, HV, V});
  DevTensor ht(kda::DType::kF32, {N, HV, K, V});
  std::vector<std::int64_t> cu_host = cu;
  std::unique_ptr<DevTensor> cu_dev;
  kda::ForwardParams p;
  p.q = q.view, p.k = k.view, p.v = v.view, p.g = g.view, p.beta = beta.view;
  p.A_log = A_log.view, p.dt_bias = dt_bias.view, p.o = o.view, p.final_state = ht.view;
  if (!cu.empty()) {
    if (cu_on_device) {
      cu_dev.reset(new DevTensor(kda::DType::kI64, {N + 1}));
      CHECK_CUDA(cudaMemcpy(cu_dev->ptr, cu_host.data(), sizeof(std::int64_t) * (N + 1), cudaMemcpyHostToDevice));
      p.cu_seqlens = cu_dev->view;
    } else {
      p.cu_seqlens = kda::TensorView::contiguous(cu_host.data(), kda::DType::kI64, {N + 1});
    }
  }
  p.options.use_gate_in_kernel = true;
  p.options.has_lower_bound = true;
  p.options.lower_bound = -5.0f;
  p.options.use_qk_l2norm_in_kernel = true;
  fail_if(kda::chunk_forward(p), name.c_str());
  const Timing t = time_call([&] { fail_if(kda::chunk_forward(p), name.c_str()); }, warmup, reps);
  char shape[128];
  std::snprintf(shape, sizeof shape, "B=1 H=HV=%lld T=%lld K=V=128 bf16 N=%lld%s", static_cast<long long>(H),
                static_cast<long long>(T), static_cast<long long>(N),
                cu.empty() ? "" : (cu_on_device ? " cu_seqlens:device" : " cu_seqlens:host"));
  char extra[96];
  std::snprintf(extra, sizeof extra, "%.1f Mtok/s", T / (t.median_ms * 1e-3) / 1e6);
  report(name, shape, t, extra);
}

// Decode: N rows, one token each, against a pool of N slots, K = V = 128.
void bench_decode(const std::string& name, std::int64_t N, std::int64_t H, double copy_gbs, int warmup, int reps) {
  const std::int64_t K = 128, V = 128, HV = H;
  DevTensor q(kda::DType::kBF16, {N, 1, H, K}, gen_normal), k(kda::DType::kBF16, {N, 1, H, K}, gen_normal);
  DevTensor v(kda::DType::kBF16, {N, 1, HV, V}, gen_normal), g(kda::DType::kBF16, {N, 1, HV, K}, gen_normal);
  DevTensor beta(kda::DType::kBF16, {N, 1, HV}, gen_beta), A_log(kda::DType::kF32, {HV}, gen_alog);
  DevTensor dt_bias(kda::DType::kF32, {HV * K}, gen_bias), o(kda::DType::kBF16, {N, 1, HV, V});
  DevTensor pool(kda::DType::kF32, {N, HV, K, V});
  std::vector<std::int32_t> idx(static_cast<std::size_t>(N));
  for (std::int64_t n = 0; n < N; ++n) idx[n] = static_cast<std::int32_t>(N - 1 - n);
  DevTensor idx_dev(kda::DType::kI32, {N});
  CHECK_CUDA(cudaMemcpy(idx_dev.ptr, idx.data(), sizeof(std::int32_t) * N, cudaMemcpyHostToDevice));
  kda::DecodeParams p;
  p.q = q.view, p.k = k.view, p.v = v.view, p.g = g.view, p.beta = beta.view;
  p.A_log = A_log.view, p.dt_bias = dt_bias.view, p.o = o.view, p.state_pool = pool.view;
  p.slot_indices = idx_dev.view;
  p.options.use_gate_in_kernel = true;
  p.options.has_lower_bound = true;
  p.options.lower_bound = -5.0f;
  p.options.use_qk_l2norm_in_kernel = true;
  fail_if(kda::decode(p), name.c_str());
  const Timing t = time_call([&] { fail_if(kda::decode(p), name.c_str()); }, warmup, reps);
  // Bytes that must move: the state read and written, the token's inputs and outputs.
  const double bytes = 2.0 * N * HV * K * V * 4 + N * (2.0 * H * K + 2.0 * HV * K + 2.0 * HV * V + 2.0 * HV) * 2;
  const double gbs = bytes / (t.median_ms * 1e-3) / 1e9;
  char shape[128];
  std::snprintf(shape, sizeof shape, "N=%lld T=1 H=HV=%lld K=V=128 bf16, fp32 pool", static_cast<long long>(N),
                static_cast<long long>(H));
  char extra[160];
  std::snprintf(extra, sizeof extra,
                "%.0f GB/s = %.0f%% of 4800 GB/s (datasheet), %.0f%% of the measured copy %.0f GB/s", gbs,
                100.0 * gbs / 4800.0, 100.0 * gbs / copy_gbs, copy_gbs);
  report(name, shape, t, extra);
}

// Device-to-device copy bandwidth (bytes read + written per second), the ceiling for decode.
double measure_copy_bandwidth() {
  const std::size_t bytes = std::size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t s, e;
  CHECK_CUDA(cudaEventCreate(&s));
  CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  std::vector<float> ms;
  for (int i = 0; i < 5; ++i) {
    CHECK_CUDA(cudaEventRecord(s));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(e));
    CHECK_CUDA(cudaEventSynchronize(e));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, s, e));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

std::vector<std::int64_t> balanced_cu(std::int64_t T, std::int64_t N) {
  std::vector<std::int64_t> cu{0};
  const std::int64_t L = T / N, r = T % N;
  for (std::int64_t i = 0; i < N; ++i) cu.push_back(cu.back() + L + (i < r ? 1 : 0));
  return cu;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  bool quick = false;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--json PATH] [--reps N] [--quick]\n", argv[0]);
      return 1;
    }
  }
  std::string why;
  if (kda::cuda_device_count(&why) == 0) {
    std::fprintf(stderr, "kda-cuda-bench: %s\n", why.c_str());
    return 4;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB, libkda %s\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              kda::version());
  if (json) g_json = std::fopen(json, "w");
  g_flush_bytes = std::max<std::size_t>(std::size_t{4} * prop.l2CacheSize, std::size_t{256} << 20);
  CHECK_CUDA(cudaMalloc(&g_flush, g_flush_bytes));
  const double copy_gbs = measure_copy_bandwidth();
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbs);
  const int warmup = 3;

  bench_forward("train_fixed", 32, 8192, {}, false, warmup, reps);
  bench_forward("train_packed25", 32, 8192, balanced_cu(8192, 25), true, warmup, reps);
  bench_forward("train_packed25_hostidx", 32, 8192, balanced_cu(8192, 25), false, warmup, reps);
  bench_decode("decode_b64", 64, 32, copy_gbs, warmup, reps);
  if (!quick) {
    bench_forward("small_fixed", 8, 1024, {}, false, warmup, reps);
    bench_forward("small_packed4", 8, 1024, {0, 100, 333, 700, 1024}, true, warmup, reps);
    bench_forward("infer_T512", 8, 512, {0, 200, 512}, true, warmup, reps);
    bench_forward("infer_T8192", 8, 8192, {0, 3000, 8192}, true, warmup, reps);
    bench_decode("decode_b1", 1, 32, copy_gbs, warmup, reps);
    bench_decode("decode_b256", 256, 32, copy_gbs, warmup, reps);
  }
  CHECK_CUDA(cudaFree(g_flush));
  if (g_json) std::fclose(g_json);
  return 0;
}

// Portable 16-lane fp32 vectors (GCC/Clang vector extensions) and the few vector math
// functions the kernels need. This file is included by each per-target kernel translation
// unit inside that target's anonymous namespace, so every function here is compiled once per
// instruction set (AVX-512 registers on the avx512 target, SSE pairs on the generic one) and
// has internal linkage: no inline function compiled for AVX-512 can leak into the generic
// target through the linker.
//
// Not included anywhere else. Needs <cstring>, <cstdint> and <type_traits> before the enclosing namespace.

// Functions whose results must be bitwise equal on every path that computes them (the fused and
// staged forwards, the backward's recomputation, saved and rebuilt states) are compiled once
// each: inlined into different callers, GCC may contract a * b + c into an FMA in one copy and
// not in another (or pick the other product), and the copies' results then differ in the last
// bit. Measured before this: an unrelated change to the decode kernels, in the same translation
// unit, changed the inlining and broke the bitwise v_new contract on the fp32 path.
#define KDA_NOINLINE __attribute__((noinline))

// The target's vector: 64 bytes (16 lanes) on the avx512 and generic targets, 32 bytes (8 lanes,
// one AVX register) on the avx2 target, whose translation unit sets KDA_VECTOR_BYTES to 32: GCC 12
// has no machine mode for a 64-byte vector without AVX-512, so there such vectors lived on the
// stack (docs/PERF.md, twenty-fourth session). Every kernel counts in kLanes, so the width is the
// only difference between the targets' sources.
#ifndef KDA_VECTOR_BYTES
#define KDA_VECTOR_BYTES 64
#endif
// Natural alignment: with a smaller one GCC 12 keeps register-blocked accumulator arrays
// (gemm_tile) partly on the stack, storing them every iteration. Memory is only ever accessed
// through vload / vstore (memcpy), so no pointer needs that alignment.
typedef float vf __attribute__((vector_size(KDA_VECTOR_BYTES)));         // kLanes x fp32
typedef std::int32_t vi __attribute__((vector_size(KDA_VECTOR_BYTES)));  // kLanes x int32
constexpr int kLanes = KDA_VECTOR_BYTES / 4;
static_assert(kLanes == 8 || kLanes == 16, "the lane shuffles below are written for 8 or 16 lanes");

static inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}
// A store of a whole 64-byte line that bypasses the caches (no read for ownership) where the ISA
// has one and p is 64-byte aligned (else a plain store). For states written to slots this call
// does not read again; fence_streams() before the writer's results are relied on.
static inline void vstore_stream(float* p, vf v) {
#if defined(__AVX512F__) && KDA_VECTOR_BYTES == 64
  if (reinterpret_cast<std::uintptr_t>(p) % 64 == 0) return _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
#elif defined(__AVX__) && KDA_VECTOR_BYTES == 32
  if (reinterpret_cast<std::uintptr_t>(p) % 32 == 0) return _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
#endif
  vstore(p, v);
}
static inline void fence_streams() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}
// Not `vf{} + x`: 0 + x is not an identity for x = -0, so the compiler would emit a scalar add
// (on an FMA port) before every broadcast.
static inline vf vsplat(float x) {
#if KDA_VECTOR_BYTES == 64
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}

// The first n (<= 16) lanes from p, the rest zero; and the matching partial store. For rows
// whose length is not a multiple of 16 and that have no padding to read into.
static inline vf vload_n(const float* p, std::int64_t n) {
  if (n >= kLanes) return vload(p);
  float t[kLanes] = {};
  std::memcpy(t, p, sizeof(float) * n);
  return vload(t);
}
static inline void vstore_n(float* p, vf v, std::int64_t n) {
  if (n >= kLanes) return vstore(p, v);
  float t[kLanes];
  vstore(t, v);
  std::memcpy(p, t, sizeof(float) * n);
}
#if KDA_VECTOR_BYTES == 64
// Sum of the 16 lanes, pairwise: lane l + lane l + 8, then + 4, + 2, + 1, in registers (the same
// additions in the same order as a loop over a stored copy, which cost a store-to-load round trip).
static inline float vsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Two-source lane shuffles of the batched sums. Of two vectors a, b as 128-bit blocks a0..a3 and
// b0..b3: halves_lo, halves_hi: [a0 a1 b0 b1], [a2 a3 b2 b3]; blocks_even, blocks_odd:
// [a0 a2 b0 b2], [a1 a3 b1 b3] (each one vshuff32x4 on AVX-512).
static inline vf halves_lo(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
}
static inline vf halves_hi(vf a, vf b) {
  return __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline vf blocks_even(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
}
static inline vf blocks_odd(vf a, vf b) {
  return __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}

// vsum of 8 vectors at once: out[i] = vsum(v[i]), bitwise, the same pairwise additions (lane l +
// lane l + 8, then + 4, + 2, + 1) in 4 steps of two-source shuffles instead of 8 x 4 one-source ones.
// Always inlined: GCC called it out of line from the V-first draft-token rows (8% of their time),
// where its inputs and outputs then went through memory.
static inline __attribute__((always_inline)) void vsum8(const vf* v, float* out) {
  vf x[4], y[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-7: v[2i]'s l + (l + 8), lanes 8-15: v[2i + 1]'s
    x[i] = halves_lo(v[2 * i], v[2 * i + 1]) + halves_hi(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i)  // 4 lanes per vector: + 4
    y[i] = blocks_even(x[2 * i], x[2 * i + 1]) + blocks_odd(x[2 * i], x[2 * i + 1]);
  // 2 lanes per vector: + 2; then + 1
  vf z = __builtin_shufflevector(y[0], y[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(y[0], y[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  z += __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  for (int i = 0; i < 8; ++i) out[i] = z[2 * i];
}

// vsum of 4 vectors at once: out[i] = vsum(v[i]), bitwise (the same pairwise additions): two
// two-source steps (+ 8, + 4) put each vector's 4 partial sums in one 128-bit block, then + 2 and
// + 1 within the blocks: 9 shuffles and adds for the 4 sums instead of 4 x 8.
static inline void vsum4(const vf* v, float* out) {
  const vf x0 = halves_lo(v[0], v[1]) + halves_hi(v[0], v[1]);
  const vf x1 = halves_lo(v[2], v[3]) + halves_hi(v[2], v[3]);
  vf y = blocks_even(x0, x1) + blocks_odd(x0, x1);
  y += __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  y += __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  for (int i = 0; i < 4; ++i) out[i] = y[4 * i];
}
#else
// The same three functions for 8 lanes: lane l + lane l + 4, then + 2, + 1.
static inline float vsum(vf v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

// out[i] = vsum(v[i]) for 4 vectors, bitwise: + 4 with two-source shuffles (lanes 0-3: v[0]'s
// partial sums, 4-7: v[1]'s), + 2 the same way (two lanes per vector), then + 1.
static inline void vsum4(const vf* v, float* out) {
  const vf x0 = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v[0], v[1], 4, 5, 6, 7, 12, 13, 14, 15);
  const vf x1 = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v[2], v[3], 4, 5, 6, 7, 12, 13, 14, 15);
  vf y = __builtin_shufflevector(x0, x1, 0, 1, 4, 5, 8, 9, 12, 13) +
         __builtin_shufflevector(x0, x1, 2, 3, 6, 7, 10, 11, 14, 15);
  y += __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6);
  for (int i = 0; i < 4; ++i) out[i] = y[2 * i];
}

static inline __attribute__((always_inline)) void vsum8(const vf* v, float* out) {
  vsum4(v, out);
  vsum4(v + 4, out + 4);
}
#endif

// e^x, about 1 ulp (Cephes expf polynomial with a two-part ln 2). Results below FLT_MIN
// flush to exactly 0 (no denormals), +-inf and NaN propagate, overflow gives +inf.
static inline vf vexp(vf x) {
  const vf log2e = vsplat(1.44269504088896341f);
  const vf c1 = vsplat(0.693359375f), c2 = vsplat(-2.12194440e-4f);
  vf xc = x > vsplat(88.3762626647949f) ? vsplat(88.3762626647949f) : x;
  xc = xc < vsplat(-87.0f) ? vsplat(-87.0f) : xc;
#ifdef __AVX512F__
  // n = nearest integer to x log2 e in one instruction (the portable floor(. + 0.5) below
  // differs only at ties, where either n keeps r in the polynomial's range)
  const vf fl = reinterpret_cast<vf>(_mm512_maskz_roundscale_ps(0xffff, reinterpret_cast<__m512>(xc * log2e),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  vf fx = xc * log2e + vsplat(0.5f);
  vi ix = __builtin_convertvector(fx, vi);
  vf fl = __builtin_convertvector(ix, vf);
  fl = fl > fx ? fl - vsplat(1.0f) : fl;  // floor
  ix = __builtin_convertvector(fl, vi);
#endif
  vf r = xc - fl * c1 - fl * c2;
  vf y = vsplat(1.9875691500e-4f);
  y = y * r + vsplat(1.3981999507e-3f);
  y = y * r + vsplat(8.3334519073e-3f);
  y = y * r + vsplat(4.1665795894e-2f);
  y = y * r + vsplat(1.6666665459e-1f);
  y = y * r + vsplat(5.0000001201e-1f);
  y = y * r * r + r + vsplat(1.0f);
#ifdef __AVX512F__
  vf res = reinterpret_cast<vf>(
      _mm512_maskz_scalef_ps(0xffff, reinterpret_cast<__m512>(y), reinterpret_cast<__m512>(fl)));  // y 2^n
#else
  vi bits = (ix + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  vf res = y * pow2;
#endif
  res = x < vsplat(-87.0f) ? vsplat(0.0f) : res;
  res = x > vsplat(88.3762626647949f) ? vsplat(__builtin_inff()) : res;
  return x != x ? x : res;
}

// log(x) for x > 0 (Cephes logf polynomial), about 1 ulp; used for softplus only.
static inline vf vlog(vf x) {
  vi bits;
  std::memcpy(&bits, &x, sizeof bits);
  vi e = ((bits >> 23) & 0xff) - 126;
  bits = (bits & 0x007fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  vf m;
  std::memcpy(&m, &bits, sizeof m);
  vf fe = __builtin_convertvector(e, vf);
  const vf sqrthf = vsplat(0.707106781186547524f);
  vf small = m < sqrthf ? vsplat(1.0f) : vsplat(0.0f);
  fe = fe - small;
  m = m + m * small - vsplat(1.0f);
  vf z = m * m;
  vf y = vsplat(7.0376836292e-2f);
  y = y * m - vsplat(1.1514610310e-1f);
  y = y * m + vsplat(1.1676998740e-1f);
  y = y * m - vsplat(1.2420140846e-1f);
  y = y * m + vsplat(1.4249322787e-1f);
  y = y * m - vsplat(1.6668057665e-1f);
  y = y * m + vsplat(2.0000714765e-1f);
  y = y * m - vsplat(2.4999993993e-1f);
  y = y * m + vsplat(3.3333331174e-1f);
  y = y * m * z;
  y = y + fe * vsplat(-2.12194440e-4f);
  y = y - vsplat(0.5f) * z;
  return m + y + fe * vsplat(0.693359375f);
}

// softplus(x) = max(x, 0) + log1p(e^-|x|); log1p(u) = log(1 + u) * u / ((1 + u) - 1) keeps
// full relative precision for small u (Goldberg's correction).
// vsoftplus_from takes u = e^-|x| from the caller, who may need it for the sigmoid as well.
static inline vf vsoftplus_from(vf x, vf u) {
  vf w = vsplat(1.0f) + u;
  vf den = w - vsplat(1.0f);
  vf l1p = den == vsplat(0.0f) ? u : vlog(w) * u / (den == vsplat(0.0f) ? vsplat(1.0f) : den);
  vf pos = x > vsplat(0.0f) ? x : vsplat(0.0f);
  vf res = pos + l1p;
  return x != x ? x : res;
}

static inline vf vsoftplus(vf x) {
  return vsoftplus_from(x, vexp(x < vsplat(0.0f) ? x : -x));
}

// x <- x * rsqrt(sum(x^2) + 1e-6) (SPEC.md 1.3) with 16 partial sums: a scalar reduction would
// be one dependent add per element. Returns the factor (the backward's l2norm adjoint needs it).
static inline float vl2normalize(float* x, std::int64_t n) {
  vf acc = vsplat(0.0f);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = vload(x + i);
    acc += v * v;
  }
  float ss = 0.0f;
  for (int l = 0; l < kLanes; ++l) ss += acc[l];
  for (; i < n; ++i) ss += x[i] * x[i];
  const vf r = vsplat(1.0f / std::sqrt(ss + 1e-6f));
  for (i = 0; i + kLanes <= n; i += kLanes) vstore(x + i, vload(x + i) * r);
  for (; i < n; ++i) x[i] *= r[0];
  return r[0];
}

// a * b + c rounded once, spelled out. Left to -ffp-contract, GCC fused the products' epilogue
// `old * cs + alpha * acc` into fma(old, cs, alpha * acc) for some unrolled elements and into
// fma(alpha, acc, old * cs) for others, differently from one instance of the tile to another, so
// one state update rounded differently in two code paths (found when the tiles gained a
// packing variant, sixteenth session). Without FMA hardware (the generic target) nothing fuses.
static inline vf vfmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__) && KDA_VECTOR_BYTES == 64
  return reinterpret_cast<vf>(
      _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__FMA__) && KDA_VECTOR_BYTES == 32
  return reinterpret_cast<vf>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// The scalar vfmadd: one rounding where the target has FMA hardware, a * b + c elsewhere, so that
// a scalar loop and its 16-lane form round alike.
static inline float sfmadd(float a, float b, float c) {
#if defined(__AVX512F__) || defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Applies f to n floats (n need not be a multiple of 16).
template <typename F>
static inline void map_rows(float* y, const float* x, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, f(vload(x + i)));
  if (i < n) {
    float tx[kLanes] = {}, ty[kLanes];
    for (std::int64_t j = i; j < n; ++j) tx[j - i] = x[j];
    vstore(ty, f(vload(tx)));
    for (std::int64_t j = i; j < n; ++j) y[j] = ty[j - i];
  }
}

// How a product step multiplies: the fp32 FMA, or (bf16 inputs, AVX512_BF16) a bf16 pair dot
// product, where one A element is a 32-bit word holding two bf16 values consecutive along the
// reduction dimension and each B row holds the matching pairs of 16 columns (pack_pairs_bf16).
struct F32Fma {
  using A = float;
  static vf step(vf acc, float a, vf b) { return acc + vsplat(a) * b; }
};
#ifdef KDA_BF16_DOT
struct Bf16Dot {
  using A = std::uint32_t;
  static vf step(vf acc, std::uint32_t a, vf b) {
    return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc),
                                                 reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a))),
                                                 reinterpret_cast<__m512bh>(b)));
  }
};
#endif

// C (m x n, ldc) += alpha * A (m x kd) * B (kd x n, ldb), n a multiple of 16 (kd counts pairs
// with Bf16Dot). A(i, p) = a[i * ars + p * acs]. With a_lower, A(i, p) = 0 for p > i and is not
// read. With c_scale, row i of C is first scaled by c_scale[i] (C = diag(c_scale) C + alpha A B),
// which saves the state update a separate pass over the state. With c_src (same ldc), the C added
// to is read from there instead (C = diag(c_scale) C_src + alpha A B), which saves a copy when the
// old state must survive; with c_src = kFromZero, C starts from zeros in registers (0 + alpha A B,
// bitwise what zeroing C first gives) and its old contents are neither read nor kept, which saves
// zeroing scratch before a product. Register-blocked: MR rows x NV vectors of accumulators. Every
// loop over the tile is unrolled by pragma: left to itself GCC 12 kept the accumulators in a stack
// array around the epilogue (36-48 stack accesses per call in the 4 x 4 tiles); unrolled, they stay
// in registers (none), and the forward ran 5-8% and the backward 2-3% faster (fourteenth session,
// docs/PERF.md).
static const float kFromZeroTag[1] = {0.0f};
static const float* const kFromZero = kFromZeroTag;  // compared, never read

// Optional second output of a product: C's new rows also as bf16 pairs of consecutive rows, the
// layout pack_pairs_bf16 writes (dst (ceil(m / 2), n; ld) 32-bit words, a missing last row read
// as 0), bitwise what packing C afterwards gives; it saves that pass over C when C (a state) is
// the B operand of the next product. Only with AVX512_BF16 (KDA_BF16_DOT) and for full products
// (Tri::kFull: every element of C written); dst = null: none.
struct PairPack {
  std::uint32_t* dst = nullptr;
  std::int64_t ld = 0;
  PairPack at(std::int64_t row, std::int64_t col) const { return {dst ? dst + row / 2 * ld + col : nullptr, ld}; }
};

#ifdef KDA_BF16_DOT
// 16 words bf16(lo[j]) | bf16(hi[j]) << 16, round to nearest even.
static inline vf pair_words(vf lo, vf hi) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi), reinterpret_cast<__m512>(lo)));  // [lo | hi]
  return reinterpret_cast<vf>(_mm512_permutexvar_epi16(interleave, both));
}
#endif

// c_src + offset, keeping null and kFromZero as they are.
static inline const float* offset_src(const float* c_src, std::int64_t offset) {
  return c_src && c_src != kFromZero ? c_src + offset : c_src;
}

// kPack: the tile also writes pack (a compile-time choice, so the tiles without it compile as if
// it did not exist: a run-time test cost the other tiles GCC's specialized clones).
template <int MR, int NV, typename Op, bool kPack = false>
static inline void gemm_tile(std::int64_t kd, const typename Op::A* a, std::int64_t ars, std::int64_t acs,
                             const float* b, std::int64_t ldb, float* c, std::int64_t ldc, float alpha,
                             const float* c_scale, const float* c_src, [[maybe_unused]] PairPack pack = {}) {
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = vsplat(0.0f);
  for (std::int64_t p = 0; p < kd; ++p) {
    vf bv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) bv[v] = vload(b + p * ldb + v * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const typename Op::A av = a[r * ars + p * acs];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = Op::step(acc[r][v], av, bv[v]);
    }
  }
  const vf al = vsplat(alpha);
  const bool from_zero = c_src == kFromZero;
  const float* src = c_src && !from_zero ? c_src : c;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const vf cs = vsplat(c_scale ? c_scale[r] : 1.0f);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * kLanes;
      const vf old = from_zero ? vsplat(0.0f) : vload(src + r * ldc + v * kLanes);
      // Each element rounds the same way in every instance of the tile (vfmadd); alpha is +-1 in
      // most products, so alpha * acc is exact and the sum rounds once.
      acc[r][v] = c_scale ? vfmadd(old, cs, al * acc[r][v]) : vfmadd(al, acc[r][v], old);  // the new C
      vstore(cp, acc[r][v]);
    }
  }
#ifdef KDA_BF16_DOT
  if constexpr (kPack) {  // rows of a tile start even (gemm's tiles are 4 or 6 rows)
#pragma GCC unroll 16
    for (int r = 0; r < MR; r += 2)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v)
        vstore(reinterpret_cast<float*>(pack.dst + r / 2 * pack.ld + v * kLanes),
               pair_words(acc[r][v], r + 1 < MR ? acc[r + 1][v] : vsplat(0.0f)));
  }
#else
  static_assert(!kPack, "PairPack needs AVX512_BF16");
#endif
}

// The widest register tile, in vectors: 4 with AVX-512's 32 registers (6 x 4 accumulators and the
// 4 B vectors fit), 2 with AVX2's 16 (6 x 2 accumulators, 2 B vectors and the broadcast: 15).
constexpr int kTileVectors = kLanes == 16 ? 4 : 2;

template <int MR, typename Op, bool kPack = false>
static inline void gemm_rows(std::int64_t n, std::int64_t kd, const typename Op::A* a, std::int64_t ars,
                             std::int64_t acs, const float* b, std::int64_t ldb, float* c, std::int64_t ldc,
                             float alpha, const float* c_scale, const float* c_src, PairPack pack = {}) {
  std::int64_t j = 0;
  auto src = [&](std::int64_t col) { return offset_src(c_src, col); };
  if constexpr (kTileVectors == 4)
    for (; j + 4 * kLanes <= n; j += 4 * kLanes)
      gemm_tile<MR, 4, Op, kPack>(kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, c_scale, src(j), pack.at(0, j));
  for (; j + 2 * kLanes <= n; j += 2 * kLanes)
    gemm_tile<MR, 2, Op, kPack>(kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, c_scale, src(j), pack.at(0, j));
  for (; j < n; j += kLanes)
    gemm_tile<MR, 1, Op, kPack>(kd, a, ars, acs, b + j, ldb, c + j, ldc, alpha, c_scale, src(j), pack.at(0, j));
}

// gemm_rows<mr> for a run-time tile height mr in [1, MR].
template <int MR, typename Op, bool kPack = false>
static inline void gemm_rows_upto(std::int64_t mr, std::int64_t n, std::int64_t kd, const typename Op::A* a,
                                  std::int64_t ars, std::int64_t acs, const float* b, std::int64_t ldb, float* c,
                                  std::int64_t ldc, float alpha, const float* c_scale, const float* c_src,
                                  PairPack pack = {}) {
  if (mr == MR)
    gemm_rows<MR, Op, kPack>(n, kd, a, ars, acs, b, ldb, c, ldc, alpha, c_scale, c_src, pack);
  else if constexpr (MR > 1)
    gemm_rows_upto<MR - 1, Op, kPack>(mr, n, kd, a, ars, acs, b, ldb, c, ldc, alpha, c_scale, c_src, pack);
}

// Which part of a product is needed, so triangular operands and outputs cost half.
enum class Tri : std::uint8_t {
  kFull,
  kALower,  // A(i, p) = 0 for p > i: only p <= i is read
  kAUpper,  // A(i, p) = 0 for p < i: only p >= i is read
  kCLower,  // only C(i, j) for j <= i is needed (columns up to the row's 16-column tile)
};

// Rows of C per register tile for a product n columns wide: 4 rows x up to 64 columns (16
// accumulators), or 6 rows (each B vector serving 6 steps) for products narrower than 32 columns
// (fp32: 64). The products here are short (8 to 256 terms per element), so the C tile's load and
// store weigh, and tiles smaller than the former 6 x 64 let them overlap the next tile's work:
// measured end to end (kda-backward-alone, alternated, docs/PERF.md, fourteenth session), smaller
// tiles made the forward and the backward each about 4% faster. kda-gemm-tiles times every
// product shape through each tile, though on this machine its single-product figures move by up
// to 20% between runs. The tile changes only which elements are computed together, never an
// element's sum, so results are bitwise the same.
template <typename Op>
static inline int gemm_tile_rows(std::int64_t n) {
  if constexpr (kLanes == 8)  // AVX2: 6 x 2 vectors is the tallest tile its 16 registers hold
    return 6;
  else if constexpr (std::is_same_v<Op, F32Fma>)
    return n >= 4 * kLanes ? 4 : 6;
  else
    return n >= 2 * kLanes ? 4 : 6;
}

#ifdef KDA_BF16_DOT
static inline void pack_pairs_bf16(const float* src, std::int64_t rows, std::int64_t n, std::int64_t lds,
                                   std::uint32_t* dst, std::int64_t ldd);
#endif

template <typename Op = F32Fma>
static inline void gemm(std::int64_t m, std::int64_t n, std::int64_t kd, const typename Op::A* a, std::int64_t ars,
                        std::int64_t acs, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, float alpha,
                        Tri tri = Tri::kFull, const float* c_scale = nullptr, const float* c_src = nullptr,
                        [[maybe_unused]] PairPack pack = {}) {
  const std::int64_t rows = gemm_tile_rows<Op>(n);
  for (std::int64_t i = 0; i < m; i += rows) {
    const std::int64_t mr = m - i < rows ? m - i : rows;
    std::int64_t p0 = 0, p1 = kd, ni = n;
    if (tri == Tri::kALower) p1 = i + mr < kd ? i + mr : kd;
    if (tri == Tri::kAUpper) p0 = i < kd ? i : kd;
    if (tri == Tri::kCLower) {
      const std::int64_t cols = (i + mr + kLanes - 1) / kLanes * kLanes;
      ni = cols < n ? cols : n;
    }
    const typename Op::A* ai = a + i * ars + p0 * acs;
    const float* bi = b + p0 * ldb;
    float* ci = c + i * ldc;
    const std::int64_t kdi = p1 - p0;
    const float* cs = c_scale ? c_scale + i : nullptr;
    const float* si = offset_src(c_src, i * ldc);
#ifdef KDA_BF16_DOT
    if constexpr (std::is_same_v<Op, Bf16Dot>)  // the fused pack exists for the bf16 products only
      if (pack.dst) {
        gemm_rows_upto<6, Op, true>(mr, ni, kdi, ai, ars, acs, bi, ldb, ci, ldc, alpha, cs, si, pack.at(i, 0));
        continue;
      }
#endif
    gemm_rows_upto<6, Op>(mr, ni, kdi, ai, ars, acs, bi, ldb, ci, ldc, alpha, cs, si);
  }
#ifdef KDA_BF16_DOT
  if constexpr (!std::is_same_v<Op, Bf16Dot>)  // other products: the same words, by a separate pass
    if (pack.dst) pack_pairs_bf16(c, m, n, ldc, pack.dst, pack.ld);
#endif
}

#ifdef KDA_BF16_DOT
// dst (ceil(rows / 2), n; ld ldd) 32-bit words: bf16(src[2p][j]) | bf16(src[2p + 1][j]) << 16,
// round to nearest even; a missing last row reads as 0. Any n (a partial last vector is masked).
// This is the B layout of Bf16Dot, and (read with a stride) its A layout when the pairs run down
// a column.
static inline void pack_pairs_bf16(const float* src, std::int64_t rows, std::int64_t n, std::int64_t lds,
                                   std::uint32_t* dst, std::int64_t ldd) {
  for (std::int64_t p = 0; 2 * p < rows; ++p) {
    const float* lo = src + 2 * p * lds;
    const bool has_hi = 2 * p + 1 < rows;
    for (std::int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 m =
          n - j >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 l = _mm512_maskz_loadu_ps(m, lo + j);
      const __m512 h = has_hi ? _mm512_maskz_loadu_ps(m, lo + lds + j) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(dst + p * ldd + j, m,
                               reinterpret_cast<__m512i>(pair_words(reinterpret_cast<vf>(l), reinterpret_cast<vf>(h))));
    }
  }
}

// dst (rows, ceil(cols / 2); ld ldd) 32-bit words: each row's bf16 values in order, pairs along
// the row (the A layout of Bf16Dot); an odd last column pairs with 0.
static inline void pack_rows_bf16(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t lds,
                                  std::uint32_t* dst, std::int64_t ldd) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* s = src + i * lds;
    std::uint32_t* d = dst + i * ldd;
    std::int64_t c = 0;
    for (; c + 2 * kLanes <= cols; c += 2 * kLanes)
      _mm512_storeu_si512(d + c / 2, reinterpret_cast<__m512i>(
                                         _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + c + kLanes), _mm512_loadu_ps(s + c))));
    if (c < cols) {
      float tail[2 * kLanes] = {};
      for (std::int64_t x = c; x < cols; ++x) tail[x - c] = s[x];
      alignas(64) std::uint32_t out[kLanes];
      _mm512_store_si512(
          out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(tail + kLanes), _mm512_loadu_ps(tail))));
      for (std::int64_t x = 0; x < (cols - c + 1) / 2; ++x) d[c / 2 + x] = out[x];
    }
  }
}
#endif

// X <- (I + L)^-1 X (kTransposed = false: forward substitution) or (I + L)^-T X (true: back
// substitution), L strictly lower triangular (rows, rows; ld ldl), X (rows, width; ld ldx),
// width a multiple of 16. NV vectors of a row stay in registers while the row is reduced.
template <bool kTransposed, int NV>
static inline void unit_lower_solve_cols(const float* L, std::int64_t ldl, float* X, std::int64_t ldx,
                                         std::int64_t rows) {
  for (std::int64_t step = 1; step < rows; ++step) {
    const std::int64_t i = kTransposed ? rows - 1 - step : step;
    float* xi = X + i * ldx;
    vf acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = vload(xi + v * kLanes);
    const std::int64_t j0 = kTransposed ? i + 1 : 0, j1 = kTransposed ? rows : i;
    for (std::int64_t j = j0; j < j1; ++j) {
      const vf l = vsplat(kTransposed ? L[j * ldl + i] : L[i * ldl + j]);
      const float* xj = X + j * ldx;
      for (int v = 0; v < NV; ++v) acc[v] -= l * vload(xj + v * kLanes);
    }
    for (int v = 0; v < NV; ++v) vstore(xi + v * kLanes, acc[v]);
  }
}

template <bool kTransposed>
static inline void unit_lower_solve(const float* L, std::int64_t ldl, float* X, std::int64_t ldx, std::int64_t rows,
                                    std::int64_t width) {
  std::int64_t c0 = 0;
  // 8 accumulators: each step of j is a dependent FMA per accumulator, so fewer would leave the
  // FMA units waiting on latency.
  for (; c0 + 8 * kLanes <= width; c0 += 8 * kLanes) unit_lower_solve_cols<kTransposed, 8>(L, ldl, X + c0, ldx, rows);
  for (; c0 + 4 * kLanes <= width; c0 += 4 * kLanes) unit_lower_solve_cols<kTransposed, 4>(L, ldl, X + c0, ldx, rows);
  for (; c0 + 2 * kLanes <= width; c0 += 2 * kLanes) unit_lower_solve_cols<kTransposed, 2>(L, ldl, X + c0, ldx, rows);
  for (; c0 < width; c0 += kLanes) unit_lower_solve_cols<kTransposed, 1>(L, ldl, X + c0, ldx, rows);
}

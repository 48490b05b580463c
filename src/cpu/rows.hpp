// Rows of fp32, bf16 and fp16 elements read and written kLanes at a time as fp32 vectors: fp32 as
// it is, bf16 / fp16 converted as they are loaded and rounded to nearest even as they are stored,
// like kda::detail::f32_to_bf16 / f32_to_f16 (core/dtype.hpp). The decode's one-token kernels take
// them as a template parameter (a narrow pool then streams once, at half the bytes);
// f16_row_to_f32 / f32_row_to_f16 (forward_kernels.inc) convert fp16 rows with F16Rows.
// Included, like simd.hpp and after it, inside a target's anonymous namespace: by
// forward_kernels.inc, and by tests/cpp/test_simd.cpp, which checks every target it can run
// against the scalar conversions. Needs <cstring>, <cstdint>, the target's intrinsics headers and
// core/dtype.hpp before the enclosing namespace.
struct F32Rows {
  using T = float;
  static vf load(const T* p) { return vload(p); }
  static void store(T* p, vf x) { vstore(p, x); }
};

typedef std::uint16_t vh __attribute__((vector_size(KDA_VECTOR_BYTES / 2)));  // kLanes x 16-bit
typedef std::uint32_t vu __attribute__((vector_size(KDA_VECTOR_BYTES)));      // kLanes x uint32

struct BF16Rows {
  using T = std::uint16_t;
  static vf load(const T* p) {
#ifdef __AVX512F__
    // (the masked forms: the unmasked ones start from an undefined vector GCC 12 warns about)
    const __m512i w = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<vf>(_mm512_maskz_slli_epi32(0xffff, w, 16));
#elif defined(__AVX2__) && KDA_VECTOR_BYTES == 32
    // The 8 values in both 128-bit halves, then one vpshufb puts each in the high half of its lane
    // over a zero low half: no shift (GCC 12 widened the generic form below in two 128-bit halves).
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                             -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return reinterpret_cast<vf>(_mm256_shuffle_epi8(both, to_high));
#else
    vh h;
    std::memcpy(&h, p, sizeof h);
    const vu w = __builtin_convertvector(h, vu) << 16;
    vf x;
    std::memcpy(&x, &w, sizeof x);
    return x;
#endif
  }
  // detail::f32_to_bf16 lane by lane: round to nearest even, NaN kept quiet.
  static void store(T* p, vf x) {
    vu w;
    std::memcpy(&w, &x, sizeof w);
#if defined(__AVX2__) && KDA_VECTOR_BYTES == 32
    // The same rounding kept in 32-bit lanes (the result is each lane's high half), NaN lanes found
    // by one unordered compare (AVX2 has no unsigned compare: the generic test took vpminud +
    // vpcmpeqd + an and), and the high halves gathered by vpshufb + vpermq: one shift a vector
    // where the generic form has three. The bf16-pool decode is compute bound on Zen 2, and there
    // this (with the load's shuffle) moved 9-12% more than the shifts (docs/PERF.md, 28th session).
    const vu rounded = w + 0x7fffu + ((w >> 16) & 1u);
    const vu nan = w | 0x400000u;
    const __m256 f = reinterpret_cast<__m256>(x);
    const __m256i h32 = reinterpret_cast<__m256i>(_mm256_blendv_ps(
        reinterpret_cast<__m256>(rounded), reinterpret_cast<__m256>(nan), _mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    const __m256i high = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_shuffle_epi8(h32, high);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
    const vu rounded = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
    const vu nan = (w >> 16) | 0x40u;
    const vu h32 = (w & 0x7fffffffu) > 0x7f800000u ? nan : rounded;  // each lane < 2^16
    const vh h = __builtin_convertvector(h32, vh);
    std::memcpy(p, &h, sizeof h);
#endif
  }
};

struct F16Rows {
  using T = std::uint16_t;
  static vf load(const T* p) {
#if defined(__AVX512F__) && KDA_VECTOR_BYTES == 64  // F16C's vcvtph2ps / vcvtps2ph (masked forms: see BF16Rows::load)
    return reinterpret_cast<vf>(_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__) && KDA_VECTOR_BYTES == 32
    return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    float t[kLanes];
    for (int i = 0; i < kLanes; ++i) t[i] = kda::detail::f16_to_f32(p[i]);
    return vload(t);
#endif
  }
  static void store(T* p, vf x) {
#if defined(__AVX512F__) && KDA_VECTOR_BYTES == 64
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(p),
        _mm512_maskz_cvtps_ph(0xffff, reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && KDA_VECTOR_BYTES == 32
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(reinterpret_cast<__m256>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    float t[kLanes];
    vstore(t, x);
    for (int i = 0; i < kLanes; ++i) p[i] = kda::detail::f32_to_f16(t[i]);
#endif
  }
};

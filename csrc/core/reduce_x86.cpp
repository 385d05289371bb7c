// The x86 vector kernels behind reduce_kernels.h: AVX2 + F16C, AVX-512 (F, BW) and AVX-512 with
// AVX512-BF16, each a Sum and a divide kernel for f32, f16 and bf16.
//
// Why the code is shaped this way:
//  * The library is compiled with plain -O3 (no -march), so everything here lives in functions with
//    __attribute__((target(...))) and is only called after the table's cpu_can_run() said yes.
//  * Vector lanes are independent elements, so a kernel is that many scalar chains side by side
//    (acc = load(s0[i]); acc = acc + load(sk[i]) for k = 1..; store(acc)); the conversions match
//    reduce.cpp's scalar ones bit for bit, NaN payloads included.
//  * Bandwidth: each source is read once and dst written once, in one pass, with four independent
//    accumulators per step so loads from all sources are in flight together.
//  * Half precision per byte. f32 Sum is bound by memory; f16 and bf16 carry half the bytes per element
//    but pay for the conversions in instructions, so those are kept few: F16C converts 8/16 lanes in one
//    instruction each way; bf16 widens with a shift and a mask and narrows with an integer round whose NaN
//    handling runs only when a vector holds a NaN (or, with AVX512-BF16, with vcvtne2ps2bf16).
#include "core/reduce_kernels.h"

#if defined(__x86_64__)

#include <cstdint>

// GCC 12's AVX-512 headers trip a false -Wmaybe-uninitialized on their own _mm512_undefined_*() (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace shardkit::core::detail {
namespace {

#define SK_AVX2 __attribute__((target("avx2,f16c")))
#define SK_AVX512 __attribute__((target("avx512f,avx512bw,avx2,f16c")))
#define SK_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,f16c")))
#define SK_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) inline
#define SK_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx2,f16c"), always_inline)) inline
#define SK_AVX512BF16_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,f16c"), always_inline)) inline

// A "lane policy" V says how one dtype loads into f32 lanes (Acc), adds, divides or multiplies, and stores
// back rounding once; kWidth is the number of elements one Acc covers. The kernel bodies at the end are
// written once over V.
//
// bf16 without shuffles: a register of bf16 pairs is split into its even elements (low halves shifted up)
// and odd elements (high halves masked), each already a valid f32. Rounding works in place on the f32 bit
// pattern (the bf16 ends up in the upper half), and the two halves are merged back with a shift and a word
// blend. This keeps the loop off the shuffle port, which the widening/narrowing moves (vpmovzxwd/vpmovdw)
// saturate. Per lane it is exactly f32_to_bf16(): +0x7FFF plus the kept lsb, or for NaN just the quiet bit.
// The NaN select costs about as much as the rounding, so store() first asks, with one unordered compare of
// the even and odd halves, whether any of the vector's elements is NaN, and takes the select only then.

struct F32x8 {
  using T = float;
  using Acc = __m256;
  static constexpr size_t kWidth = 8;
  SK_AVX2_INLINE static Acc load(const T* p) { return _mm256_loadu_ps(p); }
  SK_AVX2_INLINE static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  SK_AVX2_INLINE static Acc div(Acc a, float d) { return _mm256_div_ps(a, _mm256_set1_ps(d)); }
  SK_AVX2_INLINE static Acc mul(Acc a, float f) { return _mm256_mul_ps(a, _mm256_set1_ps(f)); }
  SK_AVX2_INLINE static void store(T* p, Acc v) { _mm256_storeu_ps(p, v); }
};
struct F16x8 {
  using T = uint16_t;
  using Acc = __m256;
  static constexpr size_t kWidth = 8;
  SK_AVX2_INLINE static Acc load(const T* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SK_AVX2_INLINE static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  SK_AVX2_INLINE static Acc div(Acc a, float d) { return _mm256_div_ps(a, _mm256_set1_ps(d)); }
  SK_AVX2_INLINE static Acc mul(Acc a, float f) { return _mm256_mul_ps(a, _mm256_set1_ps(f)); }
  SK_AVX2_INLINE static void store(T* p, Acc v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};
struct BF16x16 {
  using T = uint16_t;
  struct Acc {
    __m256 even, odd;
  };
  static constexpr size_t kWidth = 16;
  SK_AVX2_INLINE static Acc load(const T* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  SK_AVX2_INLINE static Acc add(Acc a, Acc b) {
    return {_mm256_add_ps(a.even, b.even), _mm256_add_ps(a.odd, b.odd)};
  }
  SK_AVX2_INLINE static Acc div(Acc a, float d) {
    return {_mm256_div_ps(a.even, _mm256_set1_ps(d)), _mm256_div_ps(a.odd, _mm256_set1_ps(d))};
  }
  SK_AVX2_INLINE static Acc mul(Acc a, float f) {
    return {_mm256_mul_ps(a.even, _mm256_set1_ps(f)), _mm256_mul_ps(a.odd, _mm256_set1_ps(f))};
  }
  // f32_to_bf16() on every lane that is not NaN, the bf16 in the upper 16 bits: + 0x7FFF + the kept lsb.
  SK_AVX2_INLINE static __m256i round_numbers(__m256i x) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  }
  // The same with NaN lanes kept as x with the quiet bit set.
  SK_AVX2_INLINE static __m256i round_any(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i quiet_nan = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_epi8(round_numbers(x), quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  SK_AVX2_INLINE static void store(T* p, Acc a) {
    __m256i even, odd;
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(a.even, a.odd, _CMP_UNORD_Q)) != 0, 0)) {
      even = round_any(a.even);
      odd = round_any(a.odd);
    } else {
      even = round_numbers(_mm256_castps_si256(a.even));
      odd = round_numbers(_mm256_castps_si256(a.odd));
    }
    const __m256i out = _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
  }
};

struct F32x16 {
  using T = float;
  using Acc = __m512;
  static constexpr size_t kWidth = 16;
  SK_AVX512_INLINE static Acc load(const T* p) { return _mm512_loadu_ps(p); }
  SK_AVX512_INLINE static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  SK_AVX512_INLINE static Acc div(Acc a, float d) { return _mm512_div_ps(a, _mm512_set1_ps(d)); }
  SK_AVX512_INLINE static Acc mul(Acc a, float f) { return _mm512_mul_ps(a, _mm512_set1_ps(f)); }
  SK_AVX512_INLINE static void store(T* p, Acc v) { _mm512_storeu_ps(p, v); }
};
struct F16x16 {
  using T = uint16_t;
  using Acc = __m512;
  static constexpr size_t kWidth = 16;
  SK_AVX512_INLINE static Acc load(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  SK_AVX512_INLINE static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  SK_AVX512_INLINE static Acc div(Acc a, float d) { return _mm512_div_ps(a, _mm512_set1_ps(d)); }
  SK_AVX512_INLINE static Acc mul(Acc a, float f) { return _mm512_mul_ps(a, _mm512_set1_ps(f)); }
  SK_AVX512_INLINE static void store(T* p, Acc v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
struct BF16x32 {
  using T = uint16_t;
  struct Acc {
    __m512 even, odd;
  };
  static constexpr size_t kWidth = 32;
  SK_AVX512_INLINE static Acc load(const T* p) {
    const __m512i w = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  SK_AVX512_INLINE static Acc add(Acc a, Acc b) {
    return {_mm512_add_ps(a.even, b.even), _mm512_add_ps(a.odd, b.odd)};
  }
  SK_AVX512_INLINE static Acc div(Acc a, float d) {
    return {_mm512_div_ps(a.even, _mm512_set1_ps(d)), _mm512_div_ps(a.odd, _mm512_set1_ps(d))};
  }
  SK_AVX512_INLINE static Acc mul(Acc a, float f) {
    return {_mm512_mul_ps(a.even, _mm512_set1_ps(f)), _mm512_mul_ps(a.odd, _mm512_set1_ps(f))};
  }
  // As BF16x16's, with masks: + 0x7FFF, then + 1 in the lanes whose kept lsb (bit 16) is set.
  SK_AVX512_INLINE static __m512i round_numbers(__m512i x) {
    const __m512i up = _mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF));
    const __mmask16 odd_lsb = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x10000));
    return _mm512_mask_add_epi32(up, odd_lsb, up, _mm512_set1_epi32(1));
  }
  SK_AVX512_INLINE static __m512i round_any(__m512 v) {
    const __m512i x = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(round_numbers(x), nan, x, _mm512_set1_epi32(0x00400000));
  }
  SK_AVX512_INLINE static void store(T* p, Acc a) {
    __m512i even, odd;
    if (__builtin_expect(_mm512_cmp_ps_mask(a.even, a.odd, _CMP_UNORD_Q) != 0, 0)) {
      even = round_any(a.even);
      odd = round_any(a.odd);
    } else {
      even = round_numbers(_mm512_castps_si512(a.even));
      odd = round_numbers(_mm512_castps_si512(a.odd));
    }
    _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd));
  }
};

// With AVX512-BF16, vcvtne2ps2bf16 rounds 32 lanes to nearest even in one instruction, exactly like
// f32_to_bf16() (NaN: quiet bit set, payload truncated; MXCSR ignored) except that it flushes f32 denormals
// to zero. A vector holding a denormal (rare: 0 < |x| < 2^-126) therefore takes BF16x32's integer rounding
// instead. The instruction puts the even elements in the low 16 words and the odd ones in the high 16, so
// one word permute restores the element order.
struct BF16x32Cvt : BF16x32 {
  SK_AVX512BF16_INLINE static void store(T* p, Acc a) {
    constexpr int kDenormal = 0x20;  // vfpclassps category: denormal
    if (_mm512_kor(_mm512_fpclass_ps_mask(a.even, kDenormal), _mm512_fpclass_ps_mask(a.odd, kDenormal))) {
      return BF16x32::store(p, a);
    }
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(a.odd, a.even);  // a vector cast: same 64 bytes
    // Word 2j <- word j (even element j), word 2j+1 <- word 16 + j (odd element j).
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(order, packed));
  }
};

// One body, stamped once per ISA: a template cannot take its target attribute as a parameter, and an
// untargeted shared helper would not compile (GCC refuses to inline target-specific code into it).
// Four independent steps per iteration keep loads from every source in flight; element i of every source
// is loaded before dst[i] is stored, which is what makes dst == srcs[k] safe.
#define SK_DEFINE_SUM_KERNEL(NAME, TARGET)                                                \
  template <class V>                                                                      \
  TARGET size_t NAME(void* dst, const void* const* srcs, int nsrcs, size_t count) {       \
    using T = typename V::T;                                                              \
    constexpr size_t W = V::kWidth;                                                       \
    T* d = static_cast<T*>(dst);                                                          \
    const T* s0 = static_cast<const T*>(srcs[0]);                                         \
    size_t i = 0;                                                                         \
    for (; i + 4 * W <= count; i += 4 * W) {                                              \
      auto a0 = V::load(s0 + i), a1 = V::load(s0 + i + W);                                \
      auto a2 = V::load(s0 + i + 2 * W), a3 = V::load(s0 + i + 3 * W);                    \
      for (int k = 1; k < nsrcs; ++k) {                                                   \
        const T* p = static_cast<const T*>(srcs[k]) + i;                                  \
        a0 = V::add(a0, V::load(p));                                                      \
        a1 = V::add(a1, V::load(p + W));                                                  \
        a2 = V::add(a2, V::load(p + 2 * W));                                              \
        a3 = V::add(a3, V::load(p + 3 * W));                                              \
      }                                                                                   \
      V::store(d + i, a0);                                                                \
      V::store(d + i + W, a1);                                                            \
      V::store(d + i + 2 * W, a2);                                                        \
      V::store(d + i + 3 * W, a3);                                                        \
    }                                                                                     \
    for (; i + W <= count; i += W) {                                                      \
      auto a = V::load(s0 + i);                                                           \
      for (int k = 1; k < nsrcs; ++k) a = V::add(a, V::load(static_cast<const T*>(srcs[k]) + i)); \
      V::store(d + i, a);                                                                 \
    }                                                                                     \
    return i;                                                                             \
  }

#define SK_DEFINE_DIV_KERNEL(NAME, TARGET)                                                \
  template <class V>                                                                      \
  TARGET size_t NAME(void* data, size_t count, float divisor, bool multiply) {            \
    auto* p = static_cast<typename V::T*>(data);                                          \
    size_t i = 0;                                                                         \
    if (multiply) {                                                                       \
      for (; i + V::kWidth <= count; i += V::kWidth) V::store(p + i, V::mul(V::load(p + i), divisor)); \
    } else {                                                                              \
      for (; i + V::kWidth <= count; i += V::kWidth) V::store(p + i, V::div(V::load(p + i), divisor)); \
    }                                                                                     \
    return i;                                                                             \
  }

SK_DEFINE_SUM_KERNEL(sum_avx2, SK_AVX2)
SK_DEFINE_SUM_KERNEL(sum_avx512, SK_AVX512)
SK_DEFINE_SUM_KERNEL(sum_avx512bf16, SK_AVX512BF16)
SK_DEFINE_DIV_KERNEL(div_avx2, SK_AVX2)
SK_DEFINE_DIV_KERNEL(div_avx512, SK_AVX512)
SK_DEFINE_DIV_KERNEL(div_avx512bf16, SK_AVX512BF16)
#undef SK_DEFINE_SUM_KERNEL
#undef SK_DEFINE_DIV_KERNEL

// __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). Detection can run from a
// static initializer, before libgcc's own constructor has probed the CPU, hence __builtin_cpu_init().
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
bool has_avx512_bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

constexpr IsaKernels kAvx2{"avx2", &has_avx2, &sum_avx2<F32x8>, &sum_avx2<F16x8>, &sum_avx2<BF16x16>,
                           &div_avx2<F32x8>, &div_avx2<F16x8>, &div_avx2<BF16x16>};
constexpr IsaKernels kAvx512{"avx512", &has_avx512, &sum_avx512<F32x16>, &sum_avx512<F16x16>,
                             &sum_avx512<BF16x32>, &div_avx512<F32x16>, &div_avx512<F16x16>,
                             &div_avx512<BF16x32>};
// f32 and f16 are the same as avx512's; only bf16's rounding differs.
constexpr IsaKernels kAvx512Bf16{"avx512_bf16", &has_avx512_bf16, &sum_avx512<F32x16>, &sum_avx512<F16x16>,
                                 &sum_avx512bf16<BF16x32Cvt>, &div_avx512<F32x16>, &div_avx512<F16x16>,
                                 &div_avx512bf16<BF16x32Cvt>};
constexpr const IsaKernels* kVectorIsas[] = {&kAvx512Bf16, &kAvx512, &kAvx2};

}  // namespace

const IsaKernels* const* vector_isas(size_t* count) {
  *count = sizeof(kVectorIsas) / sizeof(kVectorIsas[0]);
  return kVectorIsas;
}

}  // namespace shardkit::core::detail

#else  // not x86-64: the scalar loop only

namespace shardkit::core::detail {
const IsaKernels* const* vector_isas(size_t* count) {
  *count = 0;
  return nullptr;
}
}  // namespace shardkit::core::detail

#endif

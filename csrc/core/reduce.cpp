// Reduction loops behind reduce.h: a portable blocked scalar path for every (dtype, op), plus hand-written
// AVX2 / AVX-512 / AVX-512 with AVX512-BF16 Sum and divide kernels for f32, f16 and bf16, chosen once at
// runtime (or by SHARDKIT_REDUCE_ISA).
//
// Why the code is shaped this way:
//  * The library is compiled with plain -O3 (no -march), so anything wider than SSE2 lives in functions
//    with __attribute__((target(...))) and is only called after __builtin_cpu_supports said yes.
//  * Bitwise identical results across paths. Every path combines element i as acc = load(s0[i]);
//    acc = op(acc, load(sk[i])) for k = 1.. in order; store(acc). Vector lanes are independent elements, so
//    a vector kernel is just that many scalar chains side by side. The f16/bf16 conversions below are written
//    to match F16C (vcvtph2ps / vcvtps2ph) and the vector bf16 rounding bit for bit, NaN payloads included,
//    so a vector kernel can stop at any multiple of its width and the scalar loop finishes the tail.
//  * Exact aliasing (dst == some src) is safe because element i of every source is read before dst[i] is
//    written: the vector kernels keep the accumulators in registers, the scalar loop in a small stack block.
//  * Bandwidth: the vector kernels read each source once and write dst once, in one pass, with four
//    independent accumulators per step so loads from all sources are in flight together.
//  * Half precision per byte. f32 Sum is bound by memory; f16 and bf16 carry half the bytes per element
//    but pay for the conversions in instructions, so those are kept few: F16C converts 8/16 lanes in one
//    instruction each way; bf16 widens with a shift and a mask and narrows with an integer round whose NaN
//    handling runs only when a vector holds a NaN (or, with AVX512-BF16, with vcvtne2ps2bf16).
#include "core/reduce.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
// GCC 12's AVX-512 headers trip a false -Wmaybe-uninitialized on their own _mm512_undefined_*() (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace shardkit::core {
namespace {

// ---- scalar f16 / bf16 <-> f32 ---------------------------------------------------------------------------
// Integer-only, so the result does not depend on MXCSR (FTZ/DAZ) and matches the vector code exactly.

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  // NaN: keep sign and the top payload bits, and force the quiet bit so that truncating a payload that lives
  // only in the low 16 bits cannot turn the NaN into inf.
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  // Round to nearest even: add 0x7FFF, plus 1 if the kept lsb is odd. Overflow carries into inf correctly.
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) {
    // inf, or NaN quieted the way vcvtph2ps does it (payload shifted up, quiet bit set).
    return bits_f32(sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0u));
  }
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24 is exact in f32 and a normal f32, so FTZ/DAZ cannot touch it.
    return bits_f32(sign | f32_bits(static_cast<float>(man) * 0x1p-24f));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) {  // NaN, as vcvtps2ph: quiet bit set, top 9 payload bits kept.
    return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x1FFu));
  }
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {  // result is a normal f16 (>= 2^-14): rebias the exponent, round 13 bits away
    uint32_t r = ax - 0x38000000u;
    r += 0x0FFFu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (2^-25 itself is a tie, and 0 is even)
  // Subnormal f16: count units of 2^-24. ax's exponent is in [102, 112], so the shift is in [14, 24].
  const uint32_t e = ax >> 23;
  const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 0x400 is the smallest normal, encoded right
  return static_cast<uint16_t>(sign | q);
}

// ---- element traits: storage type T, accumulation type A -------------------------------------------------

template <class V>  // f32, f64 and the integers combine in their own type
struct EPlain {
  using T = V;
  using A = V;
  static A load(T v) { return v; }
  static T store(A a) { return a; }
};
struct EF16 {
  using T = uint16_t;
  using A = float;
  static A load(T v) { return f16_to_f32(v); }
  static T store(A a) { return f32_to_f16(a); }
};
struct EBF16 {
  using T = uint16_t;
  using A = float;
  static A load(T v) { return bf16_to_f32(v); }
  static T store(A a) { return f32_to_bf16(a); }
};
struct EBool {  // accumulates 0/1, so the bitwise ops below are the logical ones
  using T = uint8_t;
  using A = uint8_t;
  static A load(T v) { return v != 0; }
  static T store(A a) { return a; }
};

// ---- ops ------------------------------------------------------------------------------------------------

// Integers combine in their unsigned type, so Sum and Product wrap (two's complement) without signed-overflow UB.
template <class A>
using Unsigned = std::make_unsigned_t<A>;

struct OpSum {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return a + b;
    else return static_cast<A>(static_cast<Unsigned<A>>(a) + static_cast<Unsigned<A>>(b));
  }
};
struct OpProduct {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return a * b;
    else return static_cast<A>(static_cast<Unsigned<A>>(a) * static_cast<Unsigned<A>>(b));
  }
};
// Float min/max: a NaN on either side wins (a != a is the NaN test), as torch.minimum/maximum do.
struct OpMin {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a != a || a <= b) ? a : b;
    else return b < a ? b : a;
  }
};
struct OpMax {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a != a || a >= b) ? a : b;
    else return a < b ? b : a;
  }
};
struct OpBAnd {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a & b); }
};
struct OpBOr {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a | b); }
};
struct OpBXor {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a ^ b); }
};

// ---- portable blocked loop ------------------------------------------------------------------------------
// Works a block at a time through an L1-resident accumulator: each inner loop is a plain stream the compiler
// autovectorizes, every source is read once, and dst is written only after the whole block is combined.

constexpr size_t kBlock = 1024;  // elements; at most 8 KiB of accumulator

template <class E, class Op>
void reduce_scalar(void* dst, const void* const* srcs, int nsrcs, size_t begin, size_t end) {
  using T = typename E::T;
  using A = typename E::A;
  A acc[kBlock];
  T* d = static_cast<T*>(dst);
  for (size_t base = begin; base < end; base += kBlock) {
    const size_t m = std::min(kBlock, end - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t j = 0; j < m; ++j) acc[j] = E::load(s0[j]);
    for (int k = 1; k < nsrcs; ++k) {
      const T* sk = static_cast<const T*>(srcs[k]) + base;
      for (size_t j = 0; j < m; ++j) acc[j] = Op::apply(acc[j], E::load(sk[j]));
    }
    for (size_t j = 0; j < m; ++j) d[base + j] = E::store(acc[j]);
  }
}

// ---- vector Sum kernels ---------------------------------------------------------------------------------
// Each returns how many leading elements it reduced (a multiple of its width); the caller runs the scalar
// loop on the rest. A "lane policy" V says how one dtype loads into f32 lanes (Acc), adds, divides, and
// stores back rounding once; kWidth is the number of elements one Acc covers.

using SumKernel = size_t (*)(void* dst, const void* const* srcs, int nsrcs, size_t count);
using DivKernel = size_t (*)(void* data, size_t count, float divisor);  // in place, for AVG

#if defined(__x86_64__)

#define SK_AVX2 __attribute__((target("avx2,f16c")))
#define SK_AVX512 __attribute__((target("avx512f,avx512bw,avx2,f16c")))
#define SK_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,f16c")))
#define SK_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) inline
#define SK_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx2,f16c"), always_inline)) inline
#define SK_AVX512BF16_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,f16c"), always_inline)) inline

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
  TARGET size_t NAME(void* data, size_t count, float divisor) {                           \
    auto* p = static_cast<typename V::T*>(data);                                          \
    size_t i = 0;                                                                         \
    for (; i + V::kWidth <= count; i += V::kWidth) V::store(p + i, V::div(V::load(p + i), divisor)); \
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

#endif  // __x86_64__

// ---- dispatch -------------------------------------------------------------------------------------------

struct IsaKernels {  // nullptr kernels: the scalar loop does everything
  const char* name;
  SumKernel sum_f32, sum_f16, sum_bf16;
  DivKernel div_f32, div_f16, div_bf16;
};

constexpr IsaKernels kScalar{"scalar", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
#if defined(__x86_64__)
constexpr IsaKernels kAvx2{"avx2",           &sum_avx2<F32x8>, &sum_avx2<F16x8>, &sum_avx2<BF16x16>,
                           &div_avx2<F32x8>, &div_avx2<F16x8>, &div_avx2<BF16x16>};
constexpr IsaKernels kAvx512{"avx512",           &sum_avx512<F32x16>, &sum_avx512<F16x16>, &sum_avx512<BF16x32>,
                             &div_avx512<F32x16>, &div_avx512<F16x16>, &div_avx512<BF16x32>};
constexpr IsaKernels kAvx512Bf16{"avx512_bf16",      &sum_avx512<F32x16>, &sum_avx512<F16x16>,
                                 &sum_avx512bf16<BF16x32Cvt>, &div_avx512<F32x16>, &div_avx512<F16x16>,
                                 &div_avx512bf16<BF16x32Cvt>};
#endif

bool cpu_can_run(const IsaKernels* isa) {
#if defined(__x86_64__)
  // Detection can run from a static initializer, before libgcc's own constructor has probed the CPU.
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == &kAvx512Bf16) {
    return avx512 && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
  }
  if (isa == &kAvx512) return avx512;
  if (isa == &kAvx2) return avx2;
#endif
  return isa == &kScalar;
}

const IsaKernels* find_isa(const char* name, const char* where) {
  const IsaKernels* candidates[] = {
#if defined(__x86_64__)
      &kAvx512Bf16, &kAvx512, &kAvx2,
#endif
      &kScalar};
  for (const IsaKernels* c : candidates) {
    if (std::strcmp(c->name, name) != 0) continue;
    if (!cpu_can_run(c)) {
      throw std::invalid_argument(std::string("shardkit reduce: this CPU cannot run ISA '") + name + "'" + where);
    }
    return c;
  }
  throw std::invalid_argument(std::string("shardkit reduce: unknown ISA '") + name + "'" + where +
                              " (expected avx512_bf16, avx512, avx2 or scalar)");
}

// SHARDKIT_REDUCE_ISA, when set, replaces the automatic choice (like ATen's ATEN_CPU_CAPABILITY): to
// measure or check a slower path on a CPU that has a faster one. A bad value fails every reduction with
// the message above, naming the variable, rather than being ignored.
const IsaKernels* detected_isa() {
  static const IsaKernels* const best = [] {
    const char* env = std::getenv("SHARDKIT_REDUCE_ISA");
    if (env != nullptr && *env != '\0') return find_isa(env, " (from SHARDKIT_REDUCE_ISA)");
#if defined(__x86_64__)
    if (cpu_can_run(&kAvx512Bf16)) return &kAvx512Bf16;
    if (cpu_can_run(&kAvx512)) return &kAvx512;
    if (cpu_can_run(&kAvx2)) return &kAvx2;
#endif
    return &kScalar;
  }();
  return best;
}

std::atomic<const IsaKernels*> g_forced_isa{nullptr};

const IsaKernels& active_isa() {
  const IsaKernels* forced = g_forced_isa.load(std::memory_order_relaxed);
  return forced ? *forced : *detected_isa();
}

// ---- typed entry points ---------------------------------------------------------------------------------

template <class E>
void reduce_typed(void* dst, const void* const* srcs, int nsrcs, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return reduce_scalar<E, OpSum>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Product: return reduce_scalar<E, OpProduct>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Min: return reduce_scalar<E, OpMin>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Max: return reduce_scalar<E, OpMax>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      if constexpr (std::is_integral_v<typename E::A>) {
        if (op == ReduceOp::BAnd) return reduce_scalar<E, OpBAnd>(dst, srcs, nsrcs, 0, count);
        if (op == ReduceOp::BOr) return reduce_scalar<E, OpBOr>(dst, srcs, nsrcs, 0, count);
        return reduce_scalar<E, OpBXor>(dst, srcs, nsrcs, 0, count);
      }
      break;  // unreachable: validate() refused bitwise ops on floating dtypes
  }
}

void reduce_bool(void* dst, const void* const* srcs, int nsrcs, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Max:
    case ReduceOp::BOr: return reduce_scalar<EBool, OpBOr>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Product:
    case ReduceOp::Min:
    case ReduceOp::BAnd: return reduce_scalar<EBool, OpBAnd>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::BXor: return reduce_scalar<EBool, OpBXor>(dst, srcs, nsrcs, 0, count);
  }
}

template <class E>
void sum_float(SumKernel kernel, void* dst, const void* const* srcs, int nsrcs, size_t count) {
  const size_t done = kernel ? kernel(dst, srcs, nsrcs, count) : 0;
  reduce_scalar<E, OpSum>(dst, srcs, nsrcs, done, count);
}

std::string describe(ReduceOp op, DType dtype) {
  return std::string("op '") + reduce_op_name(op) + "', dtype '" + dtype_name(dtype) + "'";
}

bool is_known(ReduceOp op) { return static_cast<uint8_t>(op) <= static_cast<uint8_t>(ReduceOp::BXor); }

void validate(const void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op) {
  // Messages are built only on failure: this runs once per chunk of every collective.
  auto where = [&] { return describe(op, dtype); };
  if (!is_known(op)) {
    throw std::invalid_argument("shardkit reduce: unknown op value " + std::to_string(static_cast<int>(op)));
  }
  const size_t elem = dtype_size(dtype);  // throws for an unknown dtype value
  if (!is_integral(dtype) && (op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor)) {
    throw std::invalid_argument(std::string("shardkit reduce: op '") + reduce_op_name(op) +
                                "' is not defined for dtype '" + dtype_name(dtype) + "'");
  }
  if (nsrcs < 1) {
    throw std::invalid_argument("shardkit reduce: nsrcs must be >= 1, got " + std::to_string(nsrcs) + " (" +
                                where() + ")");
  }
  if (count == 0) return;
  if (dst == nullptr || srcs == nullptr) {
    throw std::invalid_argument("shardkit reduce: null dst or source list with count " + std::to_string(count) +
                                " (" + where() + ")");
  }
  const uintptr_t d0 = reinterpret_cast<uintptr_t>(dst);
  const size_t bytes = count * elem;
  for (int k = 0; k < nsrcs; ++k) {
    if (srcs[k] == nullptr) {
      throw std::invalid_argument("shardkit reduce: source " + std::to_string(k) + " is null (" + where() + ")");
    }
    const uintptr_t s = reinterpret_cast<uintptr_t>(srcs[k]);
    if (s != d0 && s < d0 + bytes && d0 < s + bytes) {
      throw std::invalid_argument("shardkit reduce: dst partially overlaps source " + std::to_string(k) +
                                  " (" + where() + "); it must be the same pointer or disjoint");
    }
  }
}

// Floats divide in their compute type (f32 for f16/bf16) and round once; kernel == nullptr for f64.
template <class E>
void divide_float(DivKernel kernel, void* data, size_t count, typename E::A divisor) {
  const size_t done = kernel ? kernel(data, count, static_cast<float>(divisor)) : 0;
  auto* p = static_cast<typename E::T*>(data);
  for (size_t i = done; i < count; ++i) p[i] = E::store(E::load(p[i]) / divisor);
}

template <class T>
void divide_int(T* p, size_t count, int64_t divisor) {
  if (divisor == -1) {  // x / -1 is -x; do it in unsigned so INT_MIN wraps instead of trapping
    for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(0 - static_cast<uint64_t>(p[i]));
    return;
  }
  // C++ integer division truncates toward zero, which is rounding_mode='trunc'.
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<int64_t>(p[i]) / divisor);
}

}  // namespace

void reduce_into(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op) {
  validate(dst, srcs, nsrcs, count, dtype, op);
  if (count == 0) return;
  const IsaKernels& isa = active_isa();
  const bool sum = op == ReduceOp::Sum;
  switch (dtype) {
    case DType::F32:
      if (sum) return sum_float<EPlain<float>>(isa.sum_f32, dst, srcs, nsrcs, count);
      return reduce_typed<EPlain<float>>(dst, srcs, nsrcs, count, op);
    case DType::F16:
      if (sum) return sum_float<EF16>(isa.sum_f16, dst, srcs, nsrcs, count);
      return reduce_typed<EF16>(dst, srcs, nsrcs, count, op);
    case DType::BF16:
      if (sum) return sum_float<EBF16>(isa.sum_bf16, dst, srcs, nsrcs, count);
      return reduce_typed<EBF16>(dst, srcs, nsrcs, count, op);
    case DType::F64: return reduce_typed<EPlain<double>>(dst, srcs, nsrcs, count, op);
    case DType::U8: return reduce_typed<EPlain<uint8_t>>(dst, srcs, nsrcs, count, op);
    case DType::I8: return reduce_typed<EPlain<int8_t>>(dst, srcs, nsrcs, count, op);
    case DType::I32: return reduce_typed<EPlain<int32_t>>(dst, srcs, nsrcs, count, op);
    case DType::I64: return reduce_typed<EPlain<int64_t>>(dst, srcs, nsrcs, count, op);
    case DType::Bool: return reduce_bool(dst, srcs, nsrcs, count, op);
  }
}

void divide_in_place(void* data, size_t count, DType dtype, int64_t divisor) {
  const std::string name = dtype_name(dtype);
  dtype_size(dtype);  // throws for an unknown dtype value
  if (dtype == DType::Bool) {
    throw std::invalid_argument("shardkit reduce: divide is not defined for dtype 'bool'");
  }
  if (is_integral(dtype) && divisor == 0) {
    throw std::invalid_argument("shardkit reduce: integer division by zero for dtype '" + name + "'");
  }
  if (count == 0) return;
  if (data == nullptr) {
    throw std::invalid_argument("shardkit reduce: divide got null data with count " + std::to_string(count) +
                                " for dtype '" + name + "'");
  }
  const IsaKernels& isa = active_isa();
  switch (dtype) {
    case DType::F32: return divide_float<EPlain<float>>(isa.div_f32, data, count, static_cast<float>(divisor));
    case DType::F16: return divide_float<EF16>(isa.div_f16, data, count, static_cast<float>(divisor));
    case DType::BF16: return divide_float<EBF16>(isa.div_bf16, data, count, static_cast<float>(divisor));
    case DType::F64: return divide_float<EPlain<double>>(nullptr, data, count, static_cast<double>(divisor));
    case DType::U8: return divide_int(static_cast<uint8_t*>(data), count, divisor);
    case DType::I8: return divide_int(static_cast<int8_t*>(data), count, divisor);
    case DType::I32: return divide_int(static_cast<int32_t*>(data), count, divisor);
    case DType::I64: return divide_int(static_cast<int64_t*>(data), count, divisor);
    case DType::Bool: break;  // refused above
  }
}

const char* reduce_isa() { return active_isa().name; }

void set_reduce_isa_for_testing(const char* isa) {
  if (isa == nullptr) {
    g_forced_isa.store(nullptr, std::memory_order_relaxed);
    return;
  }
  g_forced_isa.store(find_isa(isa, ""), std::memory_order_relaxed);
}

}  // namespace shardkit::core

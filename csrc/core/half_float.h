// Scalar f16 / bf16 <-> f32 conversions, torch-free, integer-only: the result does not depend on MXCSR (FTZ/DAZ),
// and matches the x86 vector conversions bit for bit (F16C's vcvtph2ps / vcvtps2ph and the vector bf16 rounding),
// NaN payloads included. Used by the reduction loops (reduce.cpp) and the quantizer (quantize.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace shardkit::core::half_float {

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

}  // namespace shardkit::core::half_float

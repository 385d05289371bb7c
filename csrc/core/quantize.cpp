// Block-wise quantization behind quantize.h.
//
// Each block is one pass to find its largest magnitude (as the integer max of the |x| bit patterns: monotone for
// non-negative floats, and inf/NaN compare above every finite value, so one compare finds them), then one pass that
// scales, rounds and clamps. Rounding is the add-and-subtract of 1.5 * 2^23, which rounds an f32 of magnitude below
// 2^22 to the nearest integer, ties to even, in the current (default) rounding mode: plain f32 arithmetic the
// compiler vectorises, with the same bits on every ISA. f16 / bf16 / f64 blocks are converted to f32 first, with the
// integer-only conversions of half_float.h.
#include "core/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/half_float.h"

namespace shardkit::core {
namespace {

constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23

float qmax_of(QuantBits bits) { return bits == QuantBits::Int8 ? 127.0f : 7.0f; }

size_t blocks_of(size_t count, uint32_t block) { return (count + block - 1) / block; }

size_t code_bytes(size_t count, QuantBits bits) { return bits == QuantBits::Int8 ? count : (count + 1) / 2; }

void check(const char* what, DType dtype, QuantFormat format) {
  if (format.exact()) throw std::invalid_argument(std::string("shardkit ") + what + ": the format is exact (nothing to quantize)");
  if (format.bits != QuantBits::Int8 && format.bits != QuantBits::Int4) {
    throw std::invalid_argument(std::string("shardkit ") + what + ": unknown bit width " +
                                std::to_string(static_cast<int>(format.bits)));
  }
  if (format.block < QuantFormat::kMinBlock || format.block > QuantFormat::kMaxBlock) {
    throw std::invalid_argument(std::string("shardkit ") + what + ": block of " + std::to_string(format.block) +
                                " elements is outside [" + std::to_string(QuantFormat::kMinBlock) + ", " +
                                std::to_string(QuantFormat::kMaxBlock) + "]");
  }
  if (!quantizable(dtype)) {
    throw std::invalid_argument(std::string("shardkit ") + what + ": dtype '" + dtype_name(dtype) +
                                "' cannot be quantized (f32, f64, f16, bf16 can)");
  }
}

// Elements [begin, begin + n) of `src` as f32: `src` itself for f32, else converted into `scratch`.
const float* as_f32(const void* src, size_t begin, size_t n, DType dtype, std::vector<float>& scratch) {
  if (dtype == DType::F32) return static_cast<const float*>(src) + begin;
  scratch.resize(n);
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::F64: scratch[i] = static_cast<float>(static_cast<const double*>(src)[begin + i]); break;
      case DType::F16: scratch[i] = half_float::f16_to_f32(static_cast<const uint16_t*>(src)[begin + i]); break;
      default: scratch[i] = half_float::bf16_to_f32(static_cast<const uint16_t*>(src)[begin + i]); break;
    }
  }
  return scratch.data();
}

// Stores n f32 values at element `begin` of `dst`, each rounded once to `dtype`.
void store(const float* values, size_t begin, size_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::F32: std::memcpy(static_cast<float*>(dst) + begin, values, n * sizeof(float)); break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) static_cast<double*>(dst)[begin + i] = values[i];
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[begin + i] = half_float::f32_to_f16(values[i]);
      break;
    default:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[begin + i] = half_float::f32_to_bf16(values[i]);
      break;
  }
}

// One block's scale and int8 codes (|code| <= qmax).
float quantize_block(const float* x, size_t n, float qmax, int8_t* codes) {
  uint32_t largest = 0;
  for (size_t i = 0; i < n; ++i) largest = std::max(largest, half_float::f32_bits(x[i]) & 0x7FFFFFFFu);
  if (largest >= 0x7F800000u) {  // inf or NaN in the block
    std::memset(codes, 0, n);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float absmax = half_float::bits_f32(largest);
  const float inverse = qmax / absmax;
  if (largest == 0 || !std::isfinite(inverse)) {
    std::memset(codes, 0, n);
    return 0.0f;
  }
  for (size_t i = 0; i < n; ++i) {
    float r = x[i] * inverse;
    r = (r + kRoundingShift) - kRoundingShift;
    r = std::min(std::max(r, -qmax), qmax);
    codes[i] = static_cast<int8_t>(static_cast<int>(r));
  }
  return absmax / qmax;
}

// Element e's nibble is the low one of byte e / 2 for even e, the high one for odd e. Codes [begin, begin + n) are
// packed in pairs where they fill whole bytes (the loop the compiler vectorises); an odd first element completes the
// byte its predecessor started, an odd last one starts a byte (its high nibble 0 until the next block fills it).
void pack_nibbles(const int8_t* block_codes, size_t begin, size_t n, unsigned char* codes) {
  size_t i = 0;
  if (begin % 2 == 1 && n > 0) {
    codes[begin / 2] = static_cast<unsigned char>((codes[begin / 2] & 0x0F) | ((block_codes[0] & 0x0F) << 4));
    i = 1;
  }
  unsigned char* out = codes + (begin + i) / 2;
  for (; i + 1 < n; i += 2) {
    *out++ = static_cast<unsigned char>((block_codes[i] & 0x0F) | ((block_codes[i + 1] & 0x0F) << 4));
  }
  if (i < n) *out = static_cast<unsigned char>(block_codes[i] & 0x0F);
}

// values[i] = code of element begin + i, times scale (the nibble sign-extended).
void unpack_nibbles(const unsigned char* codes, size_t begin, size_t n, float scale, float* values) {
  auto low = [](unsigned char byte) { return static_cast<float>(static_cast<int8_t>(byte << 4) >> 4); };
  auto high = [](unsigned char byte) { return static_cast<float>(static_cast<int8_t>(byte) >> 4); };
  size_t i = 0;
  if (begin % 2 == 1 && n > 0) {
    values[0] = high(codes[begin / 2]) * scale;
    i = 1;
  }
  const unsigned char* in = codes + (begin + i) / 2;
  for (; i + 1 < n; i += 2, ++in) {
    values[i] = low(*in) * scale;
    values[i + 1] = high(*in) * scale;
  }
  if (i < n) values[i] = low(*in) * scale;
}

}  // namespace

std::string QuantFormat::describe() const {
  if (exact()) return "exact";
  return std::string(bits == QuantBits::Int8 ? "int8" : "int4") + " (blocks of " + std::to_string(block) + ")";
}

bool quantizable(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

size_t quantized_bytes(size_t count, QuantFormat format) {
  check("quantized_bytes", DType::F32, format);
  return blocks_of(count, format.block) * sizeof(float) + code_bytes(count, format.bits);
}

void quantize(const void* src, size_t count, DType dtype, QuantFormat format, void* record) {
  check("quantize", dtype, format);
  if (count == 0) return;
  const float qmax = qmax_of(format.bits);
  auto* scales = static_cast<unsigned char*>(record);
  auto* codes = scales + blocks_of(count, format.block) * sizeof(float);
  std::vector<float> converted;
  std::vector<int8_t> block_codes(format.bits == QuantBits::Int4 ? std::min<size_t>(format.block, count) : 0);
  for (size_t begin = 0, b = 0; begin < count; begin += format.block, ++b) {
    const size_t n = std::min<size_t>(format.block, count - begin);
    const float* x = as_f32(src, begin, n, dtype, converted);
    int8_t* out = format.bits == QuantBits::Int8 ? reinterpret_cast<int8_t*>(codes) + begin : block_codes.data();
    const float scale = quantize_block(x, n, qmax, out);
    std::memcpy(scales + b * sizeof(float), &scale, sizeof(float));
    if (format.bits == QuantBits::Int4) pack_nibbles(out, begin, n, codes);
  }
}

void dequantize(const void* record, size_t count, DType dtype, QuantFormat format, void* dst) {
  check("dequantize", dtype, format);
  if (count == 0) return;
  const auto* scales = static_cast<const unsigned char*>(record);
  const auto* codes = scales + blocks_of(count, format.block) * sizeof(float);
  std::vector<float> values(std::min<size_t>(format.block, count));
  for (size_t begin = 0, b = 0; begin < count; begin += format.block, ++b) {
    const size_t n = std::min<size_t>(format.block, count - begin);
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
    if (format.bits == QuantBits::Int8) {
      const auto* in = reinterpret_cast<const int8_t*>(codes) + begin;
      for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(in[i]) * scale;
    } else {
      unpack_nibbles(codes, begin, n, scale, values.data());
    }
    store(values.data(), begin, n, dtype, dst);
  }
}

namespace {
thread_local InterHostQuantization current;
}  // namespace

QuantizationScope::QuantizationScope(InterHostQuantization quantization) : outer_(current) { current = quantization; }

QuantizationScope::~QuantizationScope() { current = outer_; }

InterHostQuantization current_quantization() { return current; }

InterHostQuantization exchange_current_quantization(InterHostQuantization quantization) {
  return std::exchange(current, quantization);
}

}  // namespace shardkit::core

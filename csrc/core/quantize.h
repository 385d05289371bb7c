// Block-wise quantization of floating data for the bytes that cross between hosts (ZeRO++'s qwZ / qgZ idea),
// torch-free.
//
// A *record* holds `count` elements of a floating dtype in `bits` bits each, in blocks of `block` elements (the last
// block may be shorter), each block with one f32 scale:
//   [scale of block 0, ..., scale of block B-1 : B f32, little-endian]  [codes]
//   int8: one signed byte per element, in [-127, 127];
//   int4: two elements a byte, element 2i in the low nibble and 2i+1 in the high one (two's complement, [-7, 7]); an
//         odd count leaves the last high nibble 0.
// Symmetric, round to nearest even: scale = absmax / qmax (qmax = 127 or 7), code = rne(x * (qmax / absmax)), and an
// element comes back as code * scale (f32 arithmetic, then rounded once to the dtype). What callers rely on:
//   * Determinism: the same input gives the same record, and a record the same values, on every rank and machine
//     (plain f32 multiplies and integer rounding, no FMA, no MXCSR dependence); so ranks that dequantize the same
//     records hold the same bits.
//   * A block holding inf or NaN comes back as NaN everywhere (scale NaN): a gradient overflow stays visible to a
//     loss scaler. A block whose absmax is 0 — or so small that qmax / absmax is not finite — comes back as zeros.
//   * |x - dequantized(x)| <= scale / 2 for every finite element, plus f32 rounding (a few ulps of the block's
//     absmax) and the dtype's own.
// Elements: f32, f64, f16, bf16 (f16/bf16/f64 are converted through f32). No alignment is required of any pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/types.h"

namespace shardkit::core {

// How many bits an element takes on the wire; Exact: not quantized.
enum class QuantBits : uint8_t { Exact = 0, Int4 = 4, Int8 = 8 };

struct QuantFormat {
  QuantBits bits = QuantBits::Exact;
  uint32_t block = 0;  // elements per scale; kMinBlock..kMaxBlock unless exact

  static constexpr uint32_t kMinBlock = 8;
  static constexpr uint32_t kMaxBlock = 1u << 20;
  bool exact() const { return bits == QuantBits::Exact; }
  bool operator==(const QuantFormat& other) const { return bits == other.bits && block == other.block; }
  // "int8 (blocks of 256)", "exact"
  std::string describe() const;
};

// True for the dtypes a record can hold.
bool quantizable(DType dtype);

// Bytes of the record of `count` elements in `format` (not Exact).
size_t quantized_bytes(size_t count, QuantFormat format);

// Writes the record of src[0, count) to `record` (quantized_bytes(count, format) bytes).
// Throws std::invalid_argument for an exact format, a block outside [kMinBlock, kMaxBlock], or a dtype that is not
// quantizable.
void quantize(const void* src, size_t count, DType dtype, QuantFormat format, void* record);

// dst[0, count) = the values `record` holds (as quantize() wrote it for `count` elements in `format`). `dst` may not
// overlap `record`. Throws as quantize().
void dequantize(const void* record, size_t count, DType dtype, QuantFormat format, void* dst);

// What a wrapper asks of the inter-host bytes of the collectives it issues: `gather` for all-gathers (weights),
// `reduce` for reduce-scatters and allreduces with a sum (gradients). Bytes inside a host always move exact.
struct InterHostQuantization {
  QuantFormat gather;
  QuantFormat reduce;

  bool exact() const { return gather.exact() && reduce.exact(); }
};

// The quantization of the collectives this thread issues from construction to destruction (scopes nest), as
// IdentityScope (collective_identity.h) does for identities: the backend reads current_quantization() when an op
// is issued, so the op carries it to whichever thread runs it.
class QuantizationScope {
 public:
  explicit QuantizationScope(InterHostQuantization quantization);
  ~QuantizationScope();
  QuantizationScope(const QuantizationScope&) = delete;
  QuantizationScope& operator=(const QuantizationScope&) = delete;

 private:
  InterHostQuantization outer_;
};

// The innermost scope's quantization on this thread; exact outside any.
InterHostQuantization current_quantization();
// Makes `quantization` this thread's current one and returns the one it replaces (for scopes a caller in another
// language keeps: python/shardkit/quantized.py).
InterHostQuantization exchange_current_quantization(InterHostQuantization quantization);

}  // namespace shardkit::core

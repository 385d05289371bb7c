// CRC32C: a portable slicing-by-8 loop and the SSE4.2 `crc32` instruction, chosen once at run time.
//
// Both paths work on the raw CRC register (the value before the final inversion): reg = ~crc on entry,
// ~reg on return, which is what makes crc32c_extend incremental.
//
// The hardware path. One `crc32` instruction folds 8 bytes into the register but has a latency of 3 cycles
// and a throughput of 1 per cycle, so one dependent chain runs at a third of what the unit can do. Long
// buffers are therefore cut into three consecutive blocks A, B, C of `stride` bytes, checksummed as three
// independent chains (A from the running register, B and C from 0), and joined exactly by linearity:
//     reg(A || B || C, r) = shift(shift(reg(A, r)) ^ reg(B, 0)) ^ reg(C, 0),
// where shift(s) is the register after `stride` zero bytes fed from s — a linear map of the 32 register bits,
// so a 4 x 256 table (one lookup per register byte) applies it. Blocks of 8 KiB while at least 24 KiB remain,
// then of 256 bytes, then one chain for the tail: the joins cost two table applications per three blocks.
#include "core/crc32c.h"

#include <cstring>
#include <stdexcept>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace shardkit::core {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, bit-reflected

// table[k][b]: the register after byte b followed by k zero bytes, from a zero register (slicing-by-8).
struct SliceTables {
  uint32_t table[8][256];
};

constexpr SliceTables make_slice_tables() {
  SliceTables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t reg = b;
    for (int bit = 0; bit < 8; ++bit) reg = (reg >> 1) ^ (kPolynomial & (0u - (reg & 1u)));
    t.table[0][b] = reg;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      const uint32_t prev = t.table[k - 1][b];
      t.table[k][b] = (prev >> 8) ^ t.table[0][prev & 0xFFu];
    }
  }
  return t;
}

constexpr SliceTables kSlice = make_slice_tables();

inline uint32_t byte_step(uint32_t reg, uint8_t byte) { return (reg >> 8) ^ kSlice.table[0][(reg ^ byte) & 0xFFu]; }

uint32_t portable_register(uint32_t reg, const uint8_t* p, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  const auto& t = kSlice.table;
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t low, high;
    std::memcpy(&low, p, 4);
    std::memcpy(&high, p + 4, 4);
    low ^= reg;
    reg = t[7][low & 0xFFu] ^ t[6][(low >> 8) & 0xFFu] ^ t[5][(low >> 16) & 0xFFu] ^ t[4][low >> 24] ^
          t[3][high & 0xFFu] ^ t[2][(high >> 8) & 0xFFu] ^ t[1][(high >> 16) & 0xFFu] ^ t[0][high >> 24];
  }
#endif
  for (; n > 0; ++p, --n) reg = byte_step(reg, *p);
  return reg;
}

// The linear map "feed `zero_bytes` zero bytes" on the register, as one lookup per register byte.
struct ShiftTable {
  uint32_t table[4][256];

  explicit ShiftTable(size_t zero_bytes) {
    uint32_t of_bit[32];
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t reg = 1u << bit;
      for (size_t i = 0; i < zero_bytes; ++i) reg = byte_step(reg, 0);
      of_bit[bit] = reg;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t image = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if (b & (1u << bit)) image ^= of_bit[8 * k + bit];
        }
        table[k][b] = image;
      }
    }
  }

  uint32_t apply(uint32_t reg) const {
    return table[0][reg & 0xFFu] ^ table[1][(reg >> 8) & 0xFFu] ^ table[2][(reg >> 16) & 0xFFu] ^
           table[3][reg >> 24];
  }
};

constexpr size_t kLongStride = 8192;
constexpr size_t kShortStride = 256;

#if defined(__x86_64__)

__attribute__((target("sse4.2"))) inline uint64_t chain8(uint64_t reg, const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return _mm_crc32_u64(reg, word);
}

// Consumes whole groups of three `stride`-byte blocks from (p, n) while at least three remain.
__attribute__((target("sse4.2"))) uint32_t three_chains(uint32_t reg, const uint8_t*& p, size_t& n,
                                                        size_t stride, const ShiftTable& shift) {
  while (n >= 3 * stride) {
    uint64_t a = reg, b = 0, c = 0;
    for (size_t i = 0; i < stride; i += 8) {
      a = chain8(a, p + i);
      b = chain8(b, p + stride + i);
      c = chain8(c, p + 2 * stride + i);
    }
    reg = shift.apply(shift.apply(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(c);
    p += 3 * stride;
    n -= 3 * stride;
  }
  return reg;
}

__attribute__((target("sse4.2"))) uint32_t hardware_register(uint32_t reg, const uint8_t* p, size_t n) {
  static const ShiftTable long_shift(kLongStride);
  static const ShiftTable short_shift(kShortStride);
  reg = three_chains(reg, p, n, kLongStride, long_shift);
  reg = three_chains(reg, p, n, kShortStride, short_shift);
  uint64_t tail = reg;
  for (; n >= 8; p += 8, n -= 8) tail = chain8(tail, p);
  reg = static_cast<uint32_t>(tail);
  for (; n > 0; ++p, --n) reg = _mm_crc32_u8(reg, *p);
  return reg;
}

bool cpu_has_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#else

bool cpu_has_sse42() { return false; }
uint32_t hardware_register(uint32_t reg, const uint8_t*, size_t) { return reg; }  // never called

#endif

bool use_hardware() {
  static const bool available = cpu_has_sse42();
  return available;
}

}  // namespace

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t size) {
  return ~portable_register(~crc, static_cast<const uint8_t*>(data), size);
}

bool crc32c_hardware_available() { return use_hardware(); }

uint32_t crc32c_extend_hardware(uint32_t crc, const void* data, size_t size) {
  if (!use_hardware()) throw std::logic_error("shardkit crc32c: this CPU has no SSE4.2 crc32 instruction");
  return ~hardware_register(~crc, static_cast<const uint8_t*>(data), size);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  return use_hardware() ? ~hardware_register(~crc, bytes, size) : ~portable_register(~crc, bytes, size);
}

const char* crc32c_isa() { return use_hardware() ? "sse4.2" : "portable"; }

}  // namespace shardkit::core

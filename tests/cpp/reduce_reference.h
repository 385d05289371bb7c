// The reference model shared by the core/reduce.h tests: an independent f16/bf16 codec (double arithmetic
// and nearbyint, no code shared with the library), the contract's combination rule per dtype and op,
// random fills, and the list of ISAs this CPU can run. Header-only; each test binary includes it once.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/reduce.h"

namespace reduce_test {

using shardkit::core::DType;
using shardkit::core::ReduceOp;
using shardkit::core::divide_in_place;
using shardkit::core::dtype_name;
using shardkit::core::dtype_size;
using shardkit::core::reduce_into;
using shardkit::core::reduce_op_name;
using shardkit::core::set_reduce_isa_for_testing;
using Bytes = std::vector<uint8_t>;

const DType kAllDtypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16, DType::U8,
                            DType::I8,  DType::I32, DType::I64, DType::Bool};
const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max,
                            ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};
const DType kFloatDtypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16};

inline bool is_float(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::F16 || d == DType::BF16; }
inline bool is_bitwise(ReduceOp op) { return op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor; }

// Every ISA this CPU can run, the automatic choice first.
inline std::vector<const char*> runnable_isas() {
  std::vector<const char*> out{nullptr};
  for (const char* isa : {"avx512_bf16", "avx512", "avx2", "scalar"}) {
    try {
      set_reduce_isa_for_testing(isa);
      out.push_back(isa);
    } catch (const std::invalid_argument&) {
    }
  }
  set_reduce_isa_for_testing(nullptr);
  return out;
}

// Restores the automatic ISA choice even when an assertion returns early.
struct IsaGuard {
  explicit IsaGuard(const char* isa) { set_reduce_isa_for_testing(isa); }
  ~IsaGuard() { set_reduce_isa_for_testing(nullptr); }
};

// ---- independent f16 / bf16 model ----------------------------------------------------------------------

struct HalfFormat {
  int mant_bits;  // explicit mantissa bits
  int exp_bits;
  int bias;
};
constexpr HalfFormat kF16{10, 5, 15};
constexpr HalfFormat kBF16{7, 8, 127};
inline const HalfFormat& format_of(DType d) { return d == DType::F16 ? kF16 : kBF16; }

inline double decode_half(uint16_t h, const HalfFormat& f) {
  const int exp_max = (1 << f.exp_bits) - 1;
  const int e = (h >> f.mant_bits) & exp_max;
  const int m = h & ((1 << f.mant_bits) - 1);
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == exp_max) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - f.bias - f.mant_bits);
  return sign * std::ldexp(m + (1 << f.mant_bits), e - f.bias - f.mant_bits);
}

// Nearest value of format f to x, ties to even, overflow to inf (IEEE round-to-nearest-even).
inline double round_to_format(double x, const HalfFormat& f) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int lead = std::max(e - 1, 1 - f.bias);  // subnormals share the smallest normal exponent's quantum
  const double quantum = std::ldexp(1.0, lead - f.mant_bits);
  const double r = std::nearbyint(x / quantum) * quantum;  // x / quantum is exact: a power-of-two scaling
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -f.mant_bits), (1 << f.exp_bits) - 2 - f.bias);
  return std::fabs(r) > max_finite ? std::copysign(INFINITY, x) : r;
}

// ---- buffers --------------------------------------------------------------------------------------------

inline double read_float(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::F32: { float v; std::memcpy(&v, &b[i * 4], 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, &b[i * 8], 8); return v; }
    default: { uint16_t h; std::memcpy(&h, &b[i * 2], 2); return decode_half(h, format_of(d)); }
  }
}

inline int64_t read_int(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::U8: case DType::Bool: return b[i];
    case DType::I8: return static_cast<int8_t>(b[i]);
    case DType::I32: { int32_t v; std::memcpy(&v, &b[i * 4], 4); return v; }
    default: { int64_t v; std::memcpy(&v, &b[i * 8], 8); return v; }
  }
}

// Moderate random data: full mantissas, products of four stay finite, no NaN/inf.
inline void fill_random(DType d, Bytes& b, std::mt19937_64& rng) {
  const size_t n = b.size() / dtype_size(d);
  std::uniform_real_distribution<double> real(-100.0, 100.0);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    switch (d) {
      case DType::F32: { float v = static_cast<float>(real(rng)); std::memcpy(&b[i * 4], &v, 4); break; }
      case DType::F64: { double v = real(rng); std::memcpy(&b[i * 8], &v, 8); break; }
      case DType::F16: case DType::BF16: {  // exponent within 2^-5 .. 2^5 of 1, random sign and mantissa
        const HalfFormat& f = format_of(d);
        const uint16_t e = static_cast<uint16_t>(f.bias - 5 + static_cast<int>(r % 11));
        const uint16_t h = static_cast<uint16_t>(((r >> 8) & 0x8000) | (e << f.mant_bits) |
                                                 ((r >> 20) & ((1u << f.mant_bits) - 1)));
        std::memcpy(&b[i * 2], &h, 2);
        break;
      }
      case DType::Bool: b[i] = (r % 5 == 0) ? static_cast<uint8_t>(r >> 32) : static_cast<uint8_t>(r & 1); break;
      default: std::memcpy(&b[i * dtype_size(d)], &r, dtype_size(d)); break;  // full range: wraps happen
    }
  }
}

template <class F>
F ref_float_op(ReduceOp op, F a, F b) {
  switch (op) {
    case ReduceOp::Sum: return a + b;
    case ReduceOp::Product: return a * b;
    case ReduceOp::Min: return std::isnan(a) || std::isnan(b) ? NAN : (b < a ? b : a);
    default: return std::isnan(a) || std::isnan(b) ? NAN : (a < b ? b : a);
  }
}

// Truncates v to the width of d, sign-extending the signed types.
inline int64_t wrap_to(DType d, uint64_t v) {
  switch (d) {
    case DType::U8: return static_cast<uint8_t>(v);
    case DType::I8: return static_cast<int8_t>(static_cast<uint8_t>(v));
    case DType::I32: return static_cast<int32_t>(static_cast<uint32_t>(v));
    default: return static_cast<int64_t>(v);
  }
}

inline int64_t ref_int_op(DType d, ReduceOp op, int64_t a, int64_t b) {
  const uint64_t ua = static_cast<uint64_t>(a), ub = static_cast<uint64_t>(b);
  if (d == DType::Bool) {
    const bool x = a != 0, y = b != 0;
    switch (op) {
      case ReduceOp::Sum: case ReduceOp::Max: case ReduceOp::BOr: return x || y;
      case ReduceOp::BXor: return x != y;
      default: return x && y;
    }
  }
  switch (op) {
    case ReduceOp::Sum: return wrap_to(d, ua + ub);
    case ReduceOp::Product: return wrap_to(d, ua * ub);
    case ReduceOp::Min: return std::min(a, b);
    case ReduceOp::Max: return std::max(a, b);
    case ReduceOp::BAnd: return wrap_to(d, ua & ub);
    case ReduceOp::BOr: return wrap_to(d, ua | ub);
    default: return wrap_to(d, ua ^ ub);
  }
}

// Expected element i, as a double (floats) or int64 (integers and bool).
inline double ref_float(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t i) {
  if (d == DType::F64) {
    double acc = read_float(d, srcs[0], i);
    for (size_t k = 1; k < srcs.size(); ++k) acc = ref_float_op(op, acc, read_float(d, srcs[k], i));
    return acc;
  }
  float acc = static_cast<float>(read_float(d, srcs[0], i));  // exact: f16/bf16 widen into f32
  for (size_t k = 1; k < srcs.size(); ++k) acc = ref_float_op(op, acc, static_cast<float>(read_float(d, srcs[k], i)));
  return d == DType::F32 ? acc : round_to_format(acc, format_of(d));
}

inline int64_t ref_int(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t i) {
  int64_t acc = d == DType::Bool ? (read_int(d, srcs[0], i) != 0) : read_int(d, srcs[0], i);
  for (size_t k = 1; k < srcs.size(); ++k) acc = ref_int_op(d, op, acc, read_int(d, srcs[k], i));
  return acc;
}

inline Bytes run_reduce(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t count) {
  Bytes out(count * dtype_size(d) + 1, 0xAB);  // one guard byte: nothing past the end may be written
  std::vector<const void*> ptrs;
  for (const Bytes& s : srcs) ptrs.push_back(s.data());
  reduce_into(out.data(), ptrs.data(), static_cast<int>(ptrs.size()), count, d, op);
  EXPECT_EQ(out.back(), 0xAB) << "wrote past the end";
  out.pop_back();
  return out;
}

// Float results match when both are NaN, or values and signs agree (value + sign is the encoding).
inline ::testing::AssertionResult float_matches(double got, double want, bool check_sign) {
  if (std::isnan(want) && std::isnan(got)) return ::testing::AssertionSuccess();
  if (got == want && (!check_sign || std::signbit(got) == std::signbit(want))) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << ", want " << want;
}

inline void expect_matches_reference(DType d, ReduceOp op, const std::vector<Bytes>& srcs, const Bytes& got, size_t count) {
  int failures = 0;
  for (size_t i = 0; i < count && failures < 5; ++i) {
    if (is_float(d)) {
      const auto ok = float_matches(read_float(d, got, i), ref_float(d, op, srcs, i),
                                    op == ReduceOp::Sum || op == ReduceOp::Product);
      if (!ok) { ++failures; ADD_FAILURE() << "element " << i << ": " << ok.message(); }
    } else if (read_int(d, got, i) != ref_int(d, op, srcs, i)) {
      ++failures;
      ADD_FAILURE() << "element " << i << ": got " << read_int(d, got, i) << ", want " << ref_int(d, op, srcs, i);
    }
  }
}

// Sum only: the result is within the rounding error bound of the f64 sum of the inputs.
inline void expect_close_to_f64_sum(DType d, const std::vector<Bytes>& srcs, const Bytes& got, size_t count) {
  const double unit = d == DType::F64 ? 0x1p-53 : 0x1p-24;
  const double out_unit = d == DType::F16 ? 0x1p-11 : d == DType::BF16 ? 0x1p-8 : 0.0;
  for (size_t i = 0; i < count; ++i) {
    double exact = 0, magnitude = 0;
    for (const Bytes& s : srcs) {
      exact += read_float(d, s, i);
      magnitude += std::fabs(read_float(d, s, i));
    }
    const double bound = magnitude * (static_cast<double>(srcs.size() - 1) * unit + out_unit);
    ASSERT_LE(std::fabs(read_float(d, got, i) - exact), bound) << "element " << i;
  }
}

}  // namespace reduce_test

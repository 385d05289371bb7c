// Tests for core/reduce.h: results against an independent reference, bitwise agreement between every ISA
// the CPU can run, aliasing, NaN handling, f16/bf16 rounding edges, divide, and error messages.
//
// The reference follows the contract literally and shares no code with the library: floats combine left to
// right in the accumulation type (f32, or f64 for f64) and f16/bf16 round once through round_to_format()
// below, built on double arithmetic and nearbyint. Sums are also checked against an f64 sum with an error
// bound, so the reference itself cannot drift from "a sum".
#include "core/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

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

bool is_float(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::F16 || d == DType::BF16; }
bool is_bitwise(ReduceOp op) { return op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor; }

// Every ISA this CPU can run, the automatic choice first.
std::vector<const char*> runnable_isas() {
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
const HalfFormat& format_of(DType d) { return d == DType::F16 ? kF16 : kBF16; }

double decode_half(uint16_t h, const HalfFormat& f) {
  const int exp_max = (1 << f.exp_bits) - 1;
  const int e = (h >> f.mant_bits) & exp_max;
  const int m = h & ((1 << f.mant_bits) - 1);
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == exp_max) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - f.bias - f.mant_bits);
  return sign * std::ldexp(m + (1 << f.mant_bits), e - f.bias - f.mant_bits);
}

// Nearest value of format f to x, ties to even, overflow to inf (IEEE round-to-nearest-even).
double round_to_format(double x, const HalfFormat& f) {
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

double read_float(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::F32: { float v; std::memcpy(&v, &b[i * 4], 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, &b[i * 8], 8); return v; }
    default: { uint16_t h; std::memcpy(&h, &b[i * 2], 2); return decode_half(h, format_of(d)); }
  }
}

int64_t read_int(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::U8: case DType::Bool: return b[i];
    case DType::I8: return static_cast<int8_t>(b[i]);
    case DType::I32: { int32_t v; std::memcpy(&v, &b[i * 4], 4); return v; }
    default: { int64_t v; std::memcpy(&v, &b[i * 8], 8); return v; }
  }
}

// Moderate random data: full mantissas, products of four stay finite, no NaN/inf.
void fill_random(DType d, Bytes& b, std::mt19937_64& rng) {
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
int64_t wrap_to(DType d, uint64_t v) {
  switch (d) {
    case DType::U8: return static_cast<uint8_t>(v);
    case DType::I8: return static_cast<int8_t>(static_cast<uint8_t>(v));
    case DType::I32: return static_cast<int32_t>(static_cast<uint32_t>(v));
    default: return static_cast<int64_t>(v);
  }
}

int64_t ref_int_op(DType d, ReduceOp op, int64_t a, int64_t b) {
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
double ref_float(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t i) {
  if (d == DType::F64) {
    double acc = read_float(d, srcs[0], i);
    for (size_t k = 1; k < srcs.size(); ++k) acc = ref_float_op(op, acc, read_float(d, srcs[k], i));
    return acc;
  }
  float acc = static_cast<float>(read_float(d, srcs[0], i));  // exact: f16/bf16 widen into f32
  for (size_t k = 1; k < srcs.size(); ++k) acc = ref_float_op(op, acc, static_cast<float>(read_float(d, srcs[k], i)));
  return d == DType::F32 ? acc : round_to_format(acc, format_of(d));
}

int64_t ref_int(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t i) {
  int64_t acc = d == DType::Bool ? (read_int(d, srcs[0], i) != 0) : read_int(d, srcs[0], i);
  for (size_t k = 1; k < srcs.size(); ++k) acc = ref_int_op(d, op, acc, read_int(d, srcs[k], i));
  return acc;
}

Bytes run_reduce(DType d, ReduceOp op, const std::vector<Bytes>& srcs, size_t count) {
  Bytes out(count * dtype_size(d) + 1, 0xAB);  // one guard byte: nothing past the end may be written
  std::vector<const void*> ptrs;
  for (const Bytes& s : srcs) ptrs.push_back(s.data());
  reduce_into(out.data(), ptrs.data(), static_cast<int>(ptrs.size()), count, d, op);
  EXPECT_EQ(out.back(), 0xAB) << "wrote past the end";
  out.pop_back();
  return out;
}

// Float results match when both are NaN, or values and signs agree (value + sign is the encoding).
::testing::AssertionResult float_matches(double got, double want, bool check_sign) {
  if (std::isnan(want) && std::isnan(got)) return ::testing::AssertionSuccess();
  if (got == want && (!check_sign || std::signbit(got) == std::signbit(want))) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << ", want " << want;
}

void expect_matches_reference(DType d, ReduceOp op, const std::vector<Bytes>& srcs, const Bytes& got, size_t count) {
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
void expect_close_to_f64_sum(DType d, const std::vector<Bytes>& srcs, const Bytes& got, size_t count) {
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

// ---- parameterised: nsrcs x count x dtype x op ----------------------------------------------------------

struct Case {
  int nsrcs;
  size_t count;
  DType dtype;
  ReduceOp op;
};

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int n : {1, 2, 3, 4})
    for (size_t count : {0, 1, 7, 16, 33, 1000, 100003})
      for (DType d : kAllDtypes)
        for (ReduceOp op : kAllOps)
          if (!(is_float(d) && is_bitwise(op))) out.push_back({n, count, d, op});
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string("n") + std::to_string(c.nsrcs) + "_c" + std::to_string(c.count) + "_" +
         dtype_name(c.dtype) + "_" + reduce_op_name(c.op);
}

class ReduceCase : public ::testing::TestWithParam<Case> {};

TEST_P(ReduceCase, MatchesReferenceOnEveryIsaAndWhenAliased) {
  const Case c = GetParam();
  std::mt19937_64 rng(c.nsrcs * 1000003u + c.count * 31u + static_cast<unsigned>(c.dtype) * 7u +
                      static_cast<unsigned>(c.op));
  const size_t bytes = c.count * dtype_size(c.dtype);
  std::vector<Bytes> srcs(c.nsrcs, Bytes(bytes));
  for (Bytes& s : srcs) fill_random(c.dtype, s, rng);

  const Bytes got = run_reduce(c.dtype, c.op, srcs, c.count);
  expect_matches_reference(c.dtype, c.op, srcs, got, c.count);
  if (is_float(c.dtype) && c.op == ReduceOp::Sum) expect_close_to_f64_sum(c.dtype, srcs, got, c.count);

  for (const char* isa : runnable_isas()) {
    IsaGuard guard(isa);
    EXPECT_TRUE(run_reduce(c.dtype, c.op, srcs, c.count) == got) << "ISA " << (isa ? isa : "auto");
    // dst aliasing the first and the last source (the shm engine reduces into its own slot).
    for (int alias : {0, c.nsrcs - 1}) {
      std::vector<Bytes> copy = srcs;
      std::vector<const void*> ptrs;
      for (const Bytes& s : copy) ptrs.push_back(s.data());
      reduce_into(copy[alias].data(), ptrs.data(), c.nsrcs, c.count, c.dtype, c.op);
      EXPECT_TRUE(copy[alias] == got) << "ISA " << (isa ? isa : "auto") << ", dst == srcs[" << alias << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ReduceCase, ::testing::ValuesIn(all_cases()), case_name);

// ---- errors ---------------------------------------------------------------------------------------------

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "<no exception>";
}

TEST(ReduceErrors, BitwiseOpOnFloatNamesOpAndDtype) {
  float a[4] = {}, b[4] = {};
  const void* srcs[] = {a, b};
  for (DType d : kFloatDtypes) {
    for (ReduceOp op : {ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor}) {
      const std::string want = std::string("shardkit reduce: op '") + reduce_op_name(op) +
                               "' is not defined for dtype '" + dtype_name(d) + "'";
      for (size_t count : {0, 2}) {  // refused even when there is nothing to do
        EXPECT_EQ(error_of([&] { reduce_into(a, srcs, 2, count, d, op); }), want);
      }
    }
  }
  EXPECT_EQ(error_of([&] { reduce_into(a, srcs, 2, 4, DType::F32, ReduceOp::BXor); }),
            "shardkit reduce: op 'bxor' is not defined for dtype 'f32'");
}

TEST(ReduceErrors, RefusesNoSourcesNullsPartialOverlapAndUnknownValues) {
  float buf[64] = {};
  const void* one[] = {buf};
  EXPECT_EQ(error_of([&] { reduce_into(buf, one, 0, 4, DType::F32, ReduceOp::Sum); }),
            "shardkit reduce: nsrcs must be >= 1, got 0 (op 'sum', dtype 'f32')");
  EXPECT_NE(error_of([&] { reduce_into(buf, one, -1, 0, DType::I32, ReduceOp::Max); }).find("nsrcs"),
            std::string::npos);
  const void* with_null[] = {buf, nullptr};
  EXPECT_NE(error_of([&] { reduce_into(buf, with_null, 2, 4, DType::F32, ReduceOp::Sum); }).find("source 1 is null"),
            std::string::npos);
  reduce_into(nullptr, nullptr, 1, 0, DType::F32, ReduceOp::Sum);  // count 0: pointers are not touched

  const void* shifted[] = {buf, buf + 1};  // dst = buf overlaps buf + 1 without being it
  EXPECT_NE(error_of([&] { reduce_into(buf, shifted, 2, 8, DType::F32, ReduceOp::Sum); }).find("partially overlaps"),
            std::string::npos);
  const void* disjoint[] = {buf, buf + 8};  // adjacent ranges are fine
  reduce_into(buf + 16, disjoint, 2, 8, DType::F32, ReduceOp::Sum);

  EXPECT_NE(error_of([&] { reduce_into(buf, one, 1, 4, static_cast<DType>(42), ReduceOp::Sum); }).find("dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] { reduce_into(buf, one, 1, 4, DType::F32, static_cast<ReduceOp>(42)); }).find("op"),
            std::string::npos);
}

// ---- NaN, rounding edges, conversions -------------------------------------------------------------------

// A NaN in any source position yields NaN at that element; elsewhere the result is an ordinary number.
TEST(ReduceFloat, NanPropagatesThroughMinMaxAndSum) {
  const size_t count = 100;  // covers vector bodies and tails
  for (const char* isa : runnable_isas()) {
    IsaGuard guard(isa);
    for (DType d : kFloatDtypes) {
      for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum}) {
        for (int n = 2; n <= 4; ++n) {
          std::mt19937_64 rng(n);
          std::vector<Bytes> srcs(n, Bytes(count * dtype_size(d)));
          for (Bytes& s : srcs) fill_random(d, s, rng);
          for (size_t i = 0; i < count; i += 3) {  // NaN in source (i/3) % n at element i
            Bytes& s = srcs[(i / 3) % n];
            if (d == DType::F32) { float v = NAN; std::memcpy(&s[i * 4], &v, 4); }
            else if (d == DType::F64) { double v = NAN; std::memcpy(&s[i * 8], &v, 8); }
            else { uint16_t h = d == DType::F16 ? 0x7E00 : 0x7FC0; std::memcpy(&s[i * 2], &h, 2); }
          }
          const Bytes got = run_reduce(d, op, srcs, count);
          for (size_t i = 0; i < count; ++i) {
            EXPECT_EQ(std::isnan(read_float(d, got, i)), i % 3 == 0)
                << dtype_name(d) << " " << reduce_op_name(op) << " n=" << n << " element " << i;
          }
        }
      }
    }
  }
}

struct HalfSumCase {
  uint16_t a, b, want;
  const char* why;
};

// Each row is reduced at 80 positions so both the vector body and the scalar tail see it.
void check_half_sums(DType d, const std::vector<HalfSumCase>& rows) {
  const size_t reps = 80;
  for (const char* isa : runnable_isas()) {
    IsaGuard guard(isa);
    for (const HalfSumCase& r : rows) {
      std::vector<uint16_t> a(reps, r.a), b(reps, r.b), out(reps, 0);
      const void* srcs[] = {a.data(), b.data()};
      reduce_into(out.data(), srcs, 2, reps, d, ReduceOp::Sum);
      for (size_t i = 0; i < reps; ++i) {
        ASSERT_EQ(out[i], r.want) << dtype_name(d) << " " << r.why << " at " << i << " ISA " << (isa ? isa : "auto");
      }
    }
  }
}

TEST(ReduceFloat, Bf16RoundingEdges) {
  check_half_sums(DType::BF16, {
      {0x3F80, 0x3B80, 0x3F80, "1 + 2^-8 is a tie: to even (down)"},
      {0x3F81, 0x3B80, 0x3F82, "(1 + 2^-7) + 2^-8 is a tie: to even (up)"},
      {0x3F80, 0x3B81, 0x3F81, "just above the tie rounds up"},
      {0xBF80, 0xBB80, 0xBF80, "negative tie to even"},
      {0x7F7F, 0x7F7F, 0x7F80, "max + max overflows to inf"},
      {0x7F7F, 0x3F80, 0x7F7F, "max + 1 stays max"},
      {0x7F80, 0x3F80, 0x7F80, "inf + 1 = inf"},
      {0xFF80, 0x3F80, 0xFF80, "-inf + 1 = -inf"},
      {0x7FC1, 0x3F80, 0x7FC1, "NaN stays NaN with its payload"},
      {0xFFC0, 0x0000, 0xFFC0, "negative NaN keeps its sign"},
      {0x8000, 0x8000, 0x8000, "-0 + -0 = -0"},
      {0x0000, 0x8000, 0x0000, "+0 + -0 = +0"},
      {0x0001, 0x0001, 0x0002, "subnormals add exactly"},
  });
  std::vector<uint16_t> a(80, 0x7F80), b(80, 0xFF80), out(80);
  const void* srcs[] = {a.data(), b.data()};
  reduce_into(out.data(), srcs, 2, 80, DType::BF16, ReduceOp::Sum);
  EXPECT_TRUE(std::isnan(decode_half(out[79], kBF16))) << "inf + -inf is NaN";
}

TEST(ReduceFloat, F16RoundingEdges) {
  check_half_sums(DType::F16, {
      {0x3C00, 0x1000, 0x3C00, "1 + 2^-11 is a tie: to even (down)"},
      {0x3C01, 0x1000, 0x3C02, "(1 + 2^-10) + 2^-11 is a tie: to even (up)"},
      {0x3C00, 0x1001, 0x3C01, "just above the tie rounds up"},
      {0x7BFF, 0x4C00, 0x7C00, "65504 + 16 = 65520 is a tie: to even is inf"},
      {0x7BFF, 0x4800, 0x7BFF, "65504 + 8 rounds back to 65504"},
      {0x7C00, 0x3C00, 0x7C00, "inf + 1 = inf"},
      {0x7E01, 0x3C00, 0x7E01, "quiet NaN keeps its payload"},
      {0x7C01, 0x3C00, 0x7E01, "signalling NaN comes out quiet"},
      {0x0001, 0x0001, 0x0002, "subnormals add exactly"},
      {0x03FF, 0x0001, 0x0400, "largest subnormal + 1 ulp is the smallest normal"},
      {0x8000, 0x8000, 0x8000, "-0 + -0 = -0"},
  });
  // Ties inside the subnormal range come from products: 2^-12 * 2^-13 = 2^-25 is half the smallest subnormal.
  std::vector<uint16_t> a{0x0C00, 0x0C00, 0x8C00}, b{0x0800, 0x0A00, 0x0A00}, out(3);
  const void* srcs[] = {a.data(), b.data()};
  reduce_into(out.data(), srcs, 2, 3, DType::F16, ReduceOp::Product);
  EXPECT_EQ(out[0], 0x0000) << "2^-25 ties to even: 0";
  EXPECT_EQ(out[1], 0x0001) << "1.5 * 2^-25 rounds up to 2^-24";
  EXPECT_EQ(out[2], 0x8001) << "sign kept";
}

// All 65536 encodings through widen + add(-0) + narrow: identity, except signalling NaNs come out quiet.
TEST(ReduceFloat, HalfConversionsAreExactForEveryEncoding) {
  for (DType d : {DType::F16, DType::BF16}) {
    const uint16_t quiet_bit = d == DType::F16 ? 0x0200 : 0x0040;
    std::vector<uint16_t> all(65536), neg_zero(65536, 0x8000), out(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    for (const char* isa : runnable_isas()) {
      IsaGuard guard(isa);
      for (int n : {1, 2}) {
        const void* srcs[] = {all.data(), neg_zero.data()};
        reduce_into(out.data(), srcs, n, all.size(), d, ReduceOp::Sum);
        int failures = 0;
        for (size_t i = 0; i < all.size() && failures < 5; ++i) {
          const uint16_t want = std::isnan(decode_half(all[i], format_of(d))) ? (all[i] | quiet_bit) : all[i];
          if (out[i] != want) {
            ++failures;
            ADD_FAILURE() << dtype_name(d) << " n=" << n << " ISA " << (isa ? isa : "auto") << ": " << std::hex
                          << all[i] << " -> " << out[i] << ", want " << want;
          }
        }
      }
    }
  }
}

// Random finite encodings of every magnitude: sums and products that overflow, underflow into subnormals
// and round in every binade, checked against the reference and across ISAs.
TEST(ReduceFloat, HalfFullRangeRandomMatchesReference) {
  const size_t count = 100003;
  for (DType d : {DType::F16, DType::BF16}) {
    const HalfFormat& f = format_of(d);
    const uint16_t exp_mask = static_cast<uint16_t>(((1 << f.exp_bits) - 1) << f.mant_bits);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product}) {
      for (int n = 2; n <= 4; ++n) {
        std::mt19937_64 rng(n * 17 + static_cast<int>(op));
        std::vector<Bytes> srcs(n, Bytes(count * 2));
        for (Bytes& s : srcs) {
          for (size_t i = 0; i < count; ++i) {
            uint16_t h;
            do h = static_cast<uint16_t>(rng()); while ((h & exp_mask) == exp_mask);  // finite only
            std::memcpy(&s[i * 2], &h, 2);
          }
        }
        const Bytes got = run_reduce(d, op, srcs, count);
        expect_matches_reference(d, op, srcs, got, count);
        for (const char* isa : runnable_isas()) {
          IsaGuard guard(isa);
          EXPECT_TRUE(run_reduce(d, op, srcs, count) == got) << dtype_name(d) << " ISA " << (isa ? isa : "auto");
        }
      }
    }
  }
}

TEST(ReduceBool, NonZeroBytesAreTrueAndResultsAreZeroOrOne) {
  const uint8_t a[] = {0x02, 0xFF, 0x00, 0x01}, b[] = {0x01, 0x80, 0x00, 0x00};
  const void* srcs[] = {a, b};
  uint8_t out[4];
  const std::pair<ReduceOp, std::vector<uint8_t>> rows[] = {
      {ReduceOp::Sum, {1, 1, 0, 1}},  {ReduceOp::Max, {1, 1, 0, 1}},     {ReduceOp::BOr, {1, 1, 0, 1}},
      {ReduceOp::Product, {1, 1, 0, 0}}, {ReduceOp::Min, {1, 1, 0, 0}}, {ReduceOp::BAnd, {1, 1, 0, 0}},
      {ReduceOp::BXor, {0, 0, 0, 1}},
  };
  for (const auto& [op, want] : rows) {
    reduce_into(out, srcs, 2, 4, DType::Bool, op);
    EXPECT_EQ(std::vector<uint8_t>(out, out + 4), want) << reduce_op_name(op);
  }
}

// ---- divide, ISA ----------------------------------------------------------------------------------------

TEST(ReduceDivide, FloatsDivideOnceInTheirComputeType) {
  std::vector<double> g{1.0, -0.0};
  divide_in_place(g.data(), g.size(), DType::F64, 0);
  EXPECT_EQ(g[0], INFINITY);
  EXPECT_TRUE(std::isnan(g[1]));
  std::mt19937 rng(7);
  std::vector<float> f(1003);  // vector body and tail
  for (float& x : f) x = std::uniform_real_distribution<float>(-1e3f, 1e3f)(rng);
  f[5] = 1e-30f;
  std::vector<uint16_t> first_f16, first_bf16;  // the automatic ISA's bytes, which every ISA must match
  for (const char* isa : runnable_isas()) {
    IsaGuard guard(isa);
    std::vector<float> q = f;
    divide_in_place(q.data(), q.size(), DType::F32, 3);
    for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(q[i], f[i] / 3.0f) << "element " << i;
    for (DType d : {DType::F16, DType::BF16}) {  // every encoding, NaN and inf included
      std::vector<uint16_t> h(65536);
      for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
      divide_in_place(h.data(), h.size(), d, 6);
      for (size_t i = 0; i < h.size(); ++i) {
        const float want = static_cast<float>(decode_half(static_cast<uint16_t>(i), format_of(d))) / 6.0f;
        ASSERT_TRUE(float_matches(decode_half(h[i], format_of(d)), round_to_format(want, format_of(d)), true))
            << dtype_name(d) << " input " << std::hex << i << " ISA " << (isa ? isa : "auto");
      }
      std::vector<uint16_t>& first = d == DType::F16 ? first_f16 : first_bf16;
      if (first.empty()) first = h;
      EXPECT_TRUE(h == first) << dtype_name(d) << " ISA " << (isa ? isa : "auto") << " differs (NaN payloads?)";
    }
  }
}

TEST(ReduceDivide, IntegersTruncateTowardZeroAndWrap) {
  std::vector<int32_t> a{-7, 7, -8, std::numeric_limits<int32_t>::min(), 1};
  divide_in_place(a.data(), a.size(), DType::I32, 2);
  EXPECT_EQ(a, (std::vector<int32_t>{-3, 3, -4, std::numeric_limits<int32_t>::min() / 2, 0}));
  std::vector<int64_t> b{std::numeric_limits<int64_t>::min(), 5};
  divide_in_place(b.data(), b.size(), DType::I64, -1);
  EXPECT_EQ(b, (std::vector<int64_t>{std::numeric_limits<int64_t>::min(), -5}));
  std::vector<int8_t> c{-128, 127, -5};
  divide_in_place(c.data(), c.size(), DType::I8, -1);
  EXPECT_EQ(c, (std::vector<int8_t>{-128, -127, 5}));
  std::vector<uint8_t> u{255, 4};
  divide_in_place(u.data(), u.size(), DType::U8, 2);
  EXPECT_EQ(u, (std::vector<uint8_t>{127, 2}));

  EXPECT_EQ(error_of([&] { divide_in_place(a.data(), a.size(), DType::I32, 0); }),
            "shardkit reduce: integer division by zero for dtype 'i32'");
  uint8_t flags[2] = {1, 0};
  EXPECT_EQ(error_of([&] { divide_in_place(flags, 2, DType::Bool, 2); }),
            "shardkit reduce: divide is not defined for dtype 'bool'");
  divide_in_place(nullptr, 0, DType::F32, 4);  // count 0 is a no-op
}

TEST(ReduceIsa, ReportsAndOverridesTheDispatch) {
  const std::string detected = shardkit::core::reduce_isa();
  EXPECT_TRUE(detected == "avx512_bf16" || detected == "avx512" || detected == "avx2" || detected == "scalar")
      << detected;
  std::cout << "[ reduce  ] dispatched ISA: " << detected << "\n";
  {
    IsaGuard guard("scalar");
    EXPECT_STREQ(shardkit::core::reduce_isa(), "scalar");
  }
  EXPECT_EQ(shardkit::core::reduce_isa(), detected);
  EXPECT_NE(error_of([] { set_reduce_isa_for_testing("sse9"); }).find("unknown ISA 'sse9'"), std::string::npos);
}

}  // namespace

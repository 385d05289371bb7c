// Tests for core/reduce.h: results against an independent reference, bitwise agreement between every ISA
// the CPU can run, aliasing, NaN handling, f16/bf16 rounding edges, divide, and error messages.
//
// The reference follows the contract literally and shares no code with the library: floats combine left to
// right in the accumulation type (f32, or f64 for f64) and f16/bf16 round once through round_to_format()
// (reduce_reference.h), built on double arithmetic and nearbyint. Sums are also checked against an f64 sum with an error
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

#include "reduce_reference.h"

namespace {

using namespace reduce_test;  // the reference model is this file's vocabulary

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

// Each reduction ISA path of core/reduce.h forced by name, one test instance per path: "avx512_bf16",
// "avx512", "avx2", "scalar". A path this CPU cannot run is reported as SKIPPED with the reason, never as a
// silent pass. (test_reduce.cpp loops over the runnable paths inside its tests; this file names them.)
//
// What the vector kernels special-case is what these tests aim at: the bf16 narrowing takes a separate
// route for a vector that holds a NaN (and, with AVX512-BF16, for one whose f32 sum is denormal, which
// vcvtne2ps2bf16 would flush), so specials are scattered one or two per vector among ordinary lanes, where
// a route chosen per vector would spoil the neighbours or miss the special. Every element is checked
// against the independent reference, NaN payloads included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/reduce.h"
#include "reduce_reference.h"

namespace {

using namespace reduce_test;  // the reference model is this file's vocabulary

const char* const kIsaNames[] = {"avx512_bf16", "avx512", "avx2", "scalar"};

class IsaPath : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    try {
      set_reduce_isa_for_testing(GetParam());
    } catch (const std::invalid_argument& error) {
      GTEST_SKIP() << "this CPU cannot run ISA '" << GetParam() << "': " << error.what();
    }
  }
  void TearDown() override { set_reduce_isa_for_testing(nullptr); }
};

TEST_P(IsaPath, IsTheDispatchedPath) { EXPECT_STREQ(shardkit::core::reduce_isa(), GetParam()); }

// ---- special values among ordinary ones ------------------------------------------------------------------

uint16_t quiet_bit(DType d) { return d == DType::F16 ? 0x0200 : 0x0040; }

// A finite value of moderate size (exponent within 2^-5 .. 2^5), random sign and mantissa.
uint16_t ordinary(DType d, std::mt19937_64& rng) {
  const HalfFormat& f = format_of(d);
  const uint64_t r = rng();
  const uint16_t e = static_cast<uint16_t>(f.bias - 5 + static_cast<int>(r % 11));
  return static_cast<uint16_t>(((r >> 8) & 0x8000) | (e << f.mant_bits) | ((r >> 20) & ((1u << f.mant_bits) - 1)));
}

// NaN (quiet or signalling, any sign and payload), +-inf, +-max finite (sums overflow), or a subnormal.
uint16_t special(DType d, std::mt19937_64& rng) {
  const HalfFormat& f = format_of(d);
  const uint16_t man_mask = static_cast<uint16_t>((1u << f.mant_bits) - 1);
  const uint16_t exp_all = static_cast<uint16_t>(((1u << f.exp_bits) - 1) << f.mant_bits);
  const uint64_t r = rng();
  const uint16_t sign = (r & 1) ? 0x8000 : 0;
  switch ((r >> 1) % 4) {
    case 0: {
      uint16_t payload = static_cast<uint16_t>((r >> 8) & man_mask);
      if (payload == 0) payload = 1;  // a zero payload would be inf
      return static_cast<uint16_t>(sign | exp_all | payload);
    }
    case 1: return static_cast<uint16_t>(sign | exp_all);
    case 2: return static_cast<uint16_t>(sign | (exp_all - (1u << f.mant_bits)) | man_mask);
    default: return static_cast<uint16_t>(sign | (((r >> 8) & man_mask) | 1));
  }
}

bool is_nan_half(DType d, uint16_t h) { return std::isnan(decode_half(h, format_of(d))); }

// Element-wise expectation: with exactly one NaN source, that NaN quieted (payload and sign kept, as the
// contract says); otherwise the reference value and sign, or some NaN where the reference is NaN (inf - inf).
void expect_half_sums(DType d, const std::vector<std::vector<uint16_t>>& srcs, const std::vector<uint16_t>& got,
                      const std::string& what) {
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    int nans = 0;
    uint16_t nan = 0;
    for (const auto& s : srcs) {
      if (is_nan_half(d, s[i])) {
        ++nans;
        nan = s[i];
      }
    }
    bool ok;
    std::string want;
    if (nans == 1) {
      ok = got[i] == (nan | quiet_bit(d));
      want = "the quieted NaN " + std::to_string(nan | quiet_bit(d));
    } else {
      std::vector<Bytes> bytes;
      for (const auto& s : srcs) bytes.emplace_back(reinterpret_cast<const uint8_t*>(s.data()),
                                                   reinterpret_cast<const uint8_t*>(s.data() + s.size()));
      const double ref = ref_float(d, ReduceOp::Sum, bytes, i);
      const auto match = float_matches(decode_half(got[i], format_of(d)), ref, true);
      ok = static_cast<bool>(match);
      want = match.message();
    }
    if (!ok) {
      ++failures;
      ADD_FAILURE() << what << " element " << i << ": got bits " << got[i] << "; " << want;
    }
  }
}

// 16..32 element vectors: a special every ~20 elements lands in most vectors, alone among ordinary lanes.
// One element in eight is all subnormal (or zero) across the sources, so its f32 sum is denormal.
TEST_P(IsaPath, HalfSumsWithScatteredSpecialsMatchTheReference) {
  const size_t count = 4099;  // whole 4x-unrolled steps, single vectors, and a scalar tail
  for (DType d : {DType::F16, DType::BF16}) {
    for (int n = 1; n <= 4; ++n) {
      std::mt19937_64 rng(static_cast<uint64_t>(n) * 131 + static_cast<uint64_t>(d));
      std::vector<std::vector<uint16_t>> srcs(n, std::vector<uint16_t>(count));
      for (size_t i = 0; i < count; ++i) {
        const bool tiny = rng() % 8 == 0;
        const size_t special_src = rng() % 20 == 0 ? rng() % n : n;  // at most one special per element
        for (int k = 0; k < n; ++k) {
          uint16_t v = ordinary(d, rng);
          if (tiny) v = static_cast<uint16_t>((v & 0x8000) | (rng() % 8));  // +-0 or a small subnormal
          if (static_cast<size_t>(k) == special_src) v = special(d, rng);
          srcs[k][i] = v;
        }
      }
      std::vector<const void*> ptrs;
      for (const auto& s : srcs) ptrs.push_back(s.data());
      std::vector<uint16_t> got(count);
      reduce_into(got.data(), ptrs.data(), n, count, d, ReduceOp::Sum);
      const std::string what = std::string(dtype_name(d)) + " n=" + std::to_string(n);
      expect_half_sums(d, srcs, got, what);

      // In place, as the shm engine reduces into its own slot: the same bytes.
      std::vector<uint16_t> inplace = srcs[0];
      ptrs[0] = inplace.data();
      reduce_into(inplace.data(), ptrs.data(), n, count, d, ReduceOp::Sum);
      EXPECT_TRUE(inplace == got) << what << ", dst == srcs[0]";
    }
  }
}

// AVG's second half: every encoding divided, rounded once from the f32 quotient. Powers of two take a
// multiply by the exact inverse inside the library, which must give the quotient's bits exactly (subnormal
// results included); 3 and 6 take the divide.
const int64_t kDivisors[] = {3, 6, 1, 2, 4, 64, -8, int64_t{1} << 40};

TEST_P(IsaPath, HalfDivideRoundsOnceForEveryEncoding) {
  for (DType d : {DType::F16, DType::BF16}) {
    for (int64_t divisor : kDivisors) {
      std::vector<uint16_t> h(65536);
      for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
      divide_in_place(h.data(), h.size(), d, divisor);
      int failures = 0;
      for (size_t i = 0; i < h.size() && failures < 5; ++i) {
        const uint16_t in = static_cast<uint16_t>(i);
        const float quotient = static_cast<float>(decode_half(in, format_of(d))) / static_cast<float>(divisor);
        const bool ok = is_nan_half(d, in) ? h[i] == (in | quiet_bit(d))
                                           : static_cast<bool>(float_matches(decode_half(h[i], format_of(d)),
                                                                             round_to_format(quotient, format_of(d)),
                                                                             true));
        if (!ok) {
          ++failures;
          ADD_FAILURE() << dtype_name(d) << " " << in << " / " << divisor << " gave bits " << h[i];
        }
      }
    }
  }
}

// f32 and f64: the library's quotient is the plain one, bit for bit (NaN payloads too), for random values
// of every magnitude including subnormals.
TEST_P(IsaPath, FloatDivideGivesThePlainQuotientsBits) {
  std::mt19937_64 rng(11);
  std::vector<uint32_t> f(1037);
  std::vector<uint64_t> g(1037);
  for (uint32_t& x : f) x = static_cast<uint32_t>(rng());
  for (uint64_t& x : g) x = rng();
  for (size_t i = 0; i < 64; ++i) {
    f[i] &= 0x807FFFFFu;  // subnormals (and zeros): their quotients lose bits, rounded
    g[i] &= 0x800FFFFFFFFFFFFFull;
  }
  for (int64_t divisor : kDivisors) {
    std::vector<uint32_t> fq = f;
    std::vector<uint64_t> gq = g;
    divide_in_place(fq.data(), fq.size(), DType::F32, divisor);
    divide_in_place(gq.data(), gq.size(), DType::F64, divisor);
    for (size_t i = 0; i < f.size(); ++i) {
      float x, want;
      std::memcpy(&x, &f[i], 4);
      want = x / static_cast<float>(divisor);
      uint32_t want_bits;
      std::memcpy(&want_bits, &want, 4);
      ASSERT_EQ(fq[i], want_bits) << "f32 element " << i << " / " << divisor;
      double y, want64;
      std::memcpy(&y, &g[i], 8);
      want64 = y / static_cast<double>(divisor);
      uint64_t want64_bits;
      std::memcpy(&want64_bits, &want64, 8);
      ASSERT_EQ(gq[i], want64_bits) << "f64 element " << i << " / " << divisor;
    }
  }
}

// f32 with one NaN, inf or overflow per element here and there: exact sums, NaN payloads kept.
TEST_P(IsaPath, F32SumsWithScatteredSpecialsMatchTheReference) {
  const size_t count = 1031;
  std::mt19937_64 rng(5);
  std::vector<Bytes> srcs(3, Bytes(count * 4));
  for (Bytes& s : srcs) fill_random(DType::F32, s, rng);
  std::vector<uint32_t> nan_bits(count, 0);
  for (size_t i = 0; i < count; i += 17) {
    const uint32_t specials[] = {0x7FA00001u | static_cast<uint32_t>(i), 0xFF800000u, 0x7F7FFFFFu};
    const uint32_t v = specials[i % 3];
    std::memcpy(&srcs[i % 3][i * 4], &v, 4);
    if (i % 3 == 0) nan_bits[i] = v | 0x00400000u;  // the NaN comes out quiet, payload kept
  }
  std::vector<const void*> ptrs;
  for (const Bytes& s : srcs) ptrs.push_back(s.data());
  std::vector<uint32_t> got(count);
  reduce_into(got.data(), ptrs.data(), 3, count, DType::F32, ReduceOp::Sum);
  for (size_t i = 0; i < count; ++i) {
    if (nan_bits[i] != 0) {
      ASSERT_EQ(got[i], nan_bits[i]) << "element " << i;
      continue;
    }
    float value;
    std::memcpy(&value, &got[i], 4);
    ASSERT_TRUE(float_matches(value, ref_float(DType::F32, ReduceOp::Sum, srcs, i), true)) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Each, IsaPath, ::testing::ValuesIn(kIsaNames),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

}  // namespace

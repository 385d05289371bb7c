// Tests for core/quantize.h: records against an independent reference (double arithmetic, std::nearbyint), the error
// bound, exact record sizes, int4 packing, the non-finite and tiny-block rules, f16/bf16/f64, and error messages.
#include "core/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/half_float.h"

namespace {

using shardkit::core::DType;
using shardkit::core::QuantBits;
using shardkit::core::QuantFormat;

std::vector<float> random_values(size_t count, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// The contract, written out in double: scale = absmax / qmax and code = rne(x * qmax / absmax), both computed in f32
// as the header says; the code is checked exactly and the value as code * scale.
struct Reference {
  std::vector<float> scales;
  std::vector<int> codes;
};

Reference reference(const std::vector<float>& x, QuantFormat format) {
  const float qmax = format.bits == QuantBits::Int8 ? 127.0f : 7.0f;
  Reference ref;
  for (size_t begin = 0; begin < x.size(); begin += format.block) {
    const size_t end = std::min(x.size(), begin + format.block);
    float absmax = 0;
    for (size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    const float inverse = qmax / absmax;
    ref.scales.push_back(absmax == 0 ? 0.0f : absmax / qmax);
    for (size_t i = begin; i < end; ++i) {
      const double scaled = static_cast<double>(static_cast<float>(x[i] * inverse));
      ref.codes.push_back(absmax == 0 ? 0 : static_cast<int>(std::clamp(std::nearbyint(scaled), -double(qmax), double(qmax))));
    }
  }
  return ref;
}

int code_at(const std::vector<unsigned char>& record, size_t blocks, size_t e, QuantBits bits) {
  const unsigned char* codes = record.data() + blocks * sizeof(float);
  if (bits == QuantBits::Int8) return static_cast<int8_t>(codes[e]);
  const int nibble = e % 2 == 0 ? (codes[e / 2] & 0x0F) : (codes[e / 2] >> 4);
  return nibble >= 8 ? nibble - 16 : nibble;
}

// An f32 rounded once to f16 or bf16, and widened back.
float round_to(DType dtype, float value) {
  namespace hf = shardkit::core::half_float;
  return dtype == DType::BF16 ? hf::bf16_to_f32(hf::f32_to_bf16(value)) : hf::f16_to_f32(hf::f32_to_f16(value));
}

class QuantizeF32 : public ::testing::TestWithParam<std::tuple<QuantBits, uint32_t, size_t>> {};

TEST_P(QuantizeF32, MatchesReferenceAndBound) {
  const auto [bits, block, count] = GetParam();
  const QuantFormat format{bits, block};
  const std::vector<float> x = random_values(count, static_cast<unsigned>(count * 31 + block));
  const size_t blocks = (count + block - 1) / block;
  const size_t code_bytes = bits == QuantBits::Int8 ? count : (count + 1) / 2;
  ASSERT_EQ(shardkit::core::quantized_bytes(count, format), blocks * 4 + code_bytes);

  std::vector<unsigned char> record(shardkit::core::quantized_bytes(count, format), 0xAB);
  shardkit::core::quantize(x.data(), count, DType::F32, format, record.data());
  const Reference ref = reference(x, format);
  for (size_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, record.data() + 4 * b, 4);
    ASSERT_EQ(scale, ref.scales[b]) << "block " << b;
  }
  for (size_t e = 0; e < count; ++e) ASSERT_EQ(code_at(record, blocks, e, bits), ref.codes[e]) << "element " << e;
  if (bits == QuantBits::Int4 && count % 2 == 1) {
    EXPECT_EQ(record.back() >> 4, 0) << "the unused high nibble";
  }

  std::vector<float> back(count);
  shardkit::core::dequantize(record.data(), count, DType::F32, format, back.data());
  for (size_t e = 0; e < count; ++e) {
    const float scale = ref.scales[e / block];
    ASSERT_EQ(back[e], static_cast<float>(ref.codes[e]) * scale) << "element " << e;
    const float absmax = scale * (bits == QuantBits::Int8 ? 127.0f : 7.0f);
    ASSERT_LE(std::fabs(back[e] - x[e]), scale / 2 + 4 * std::numeric_limits<float>::epsilon() * absmax)
        << "element " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizeF32,
                         ::testing::Combine(::testing::Values(QuantBits::Int8, QuantBits::Int4),
                                            ::testing::Values(8u, 9u, 64u, 255u, 1000u),
                                            ::testing::Values(size_t{1}, size_t{7}, size_t{256}, size_t{1001},
                                                              size_t{70000})));

TEST(Quantize, ExtremesOfABlockAreExact) {
  // The largest magnitude maps to +-qmax and comes back as absmax / qmax * qmax; zero stays zero.
  std::vector<float> x = {0.0f, -2.5f, 1.0f, 2.5f, 0.0f, -0.0f, 0.5f, -1.25f};
  for (QuantBits bits : {QuantBits::Int8, QuantBits::Int4}) {
    const QuantFormat format{bits, 8};
    std::vector<unsigned char> record(shardkit::core::quantized_bytes(x.size(), format));
    shardkit::core::quantize(x.data(), x.size(), DType::F32, format, record.data());
    std::vector<float> back(x.size());
    shardkit::core::dequantize(record.data(), x.size(), DType::F32, format, back.data());
    const float qmax = bits == QuantBits::Int8 ? 127.0f : 7.0f;
    EXPECT_EQ(back[0], 0.0f);
    EXPECT_EQ(back[3], 2.5f / qmax * qmax);
    EXPECT_EQ(back[1], -(2.5f / qmax * qmax));
  }
}

TEST(Quantize, NonFiniteBlockBecomesNaNAndOthersAreUntouched) {
  std::vector<float> x(32, 1.0f);
  x[3] = std::numeric_limits<float>::infinity();
  x[17] = std::numeric_limits<float>::quiet_NaN();
  x[20] = 0.0f;
  const QuantFormat format{QuantBits::Int8, 8};
  std::vector<unsigned char> record(shardkit::core::quantized_bytes(x.size(), format));
  shardkit::core::quantize(x.data(), x.size(), DType::F32, format, record.data());
  std::vector<float> back(x.size());
  shardkit::core::dequantize(record.data(), x.size(), DType::F32, format, back.data());
  for (size_t e = 0; e < x.size(); ++e) {
    const bool poisoned = e / 8 == 0 || e / 8 == 2;  // blocks 0 (inf) and 2 (NaN)
    if (poisoned) {
      EXPECT_TRUE(std::isnan(back[e])) << "element " << e;
    } else {
      EXPECT_EQ(back[e], 1.0f) << "element " << e;
    }
  }
}

TEST(Quantize, ZeroAndTinyBlocksComeBackAsZeros) {
  std::vector<float> x(16, 0.0f);
  for (size_t e = 8; e < 16; ++e) x[e] = std::numeric_limits<float>::denorm_min() * static_cast<float>(e);
  const QuantFormat format{QuantBits::Int8, 8};
  std::vector<unsigned char> record(shardkit::core::quantized_bytes(x.size(), format));
  shardkit::core::quantize(x.data(), x.size(), DType::F32, format, record.data());
  std::vector<float> back(x.size(), 1.0f);
  shardkit::core::dequantize(record.data(), x.size(), DType::F32, format, back.data());
  for (float v : back) EXPECT_EQ(v, 0.0f);
}

TEST(Quantize, HalfTypesAndF64GoThroughF32) {
  const std::vector<float> x = random_values(300, 7);
  const QuantFormat format{QuantBits::Int8, 64};
  std::vector<unsigned char> expected(shardkit::core::quantized_bytes(x.size(), format));
  std::vector<float> rounded(x.size());
  std::vector<uint16_t> bf16(x.size()), f16(x.size());
  std::vector<double> f64(x.begin(), x.end());
  for (size_t e = 0; e < x.size(); ++e) {
    bf16[e] = shardkit::core::half_float::f32_to_bf16(x[e]);
    f16[e] = shardkit::core::half_float::f32_to_f16(x[e]);
  }
  struct Case {
    DType dtype;
    const void* data;
    float (*widen)(const void*, size_t);
  };
  const Case cases[] = {
      {DType::BF16, bf16.data(), [](const void* p, size_t e) { return shardkit::core::half_float::bf16_to_f32(static_cast<const uint16_t*>(p)[e]); }},
      {DType::F16, f16.data(), [](const void* p, size_t e) { return shardkit::core::half_float::f16_to_f32(static_cast<const uint16_t*>(p)[e]); }},
      {DType::F64, f64.data(), [](const void* p, size_t e) { return static_cast<float>(static_cast<const double*>(p)[e]); }},
  };
  for (const Case& c : cases) {
    for (size_t e = 0; e < x.size(); ++e) rounded[e] = c.widen(c.data, e);
    shardkit::core::quantize(rounded.data(), x.size(), DType::F32, format, expected.data());
    std::vector<unsigned char> record(expected.size());
    shardkit::core::quantize(c.data, x.size(), c.dtype, format, record.data());
    EXPECT_EQ(record, expected) << shardkit::core::dtype_name(c.dtype);
    std::vector<float> as_f32(x.size());
    shardkit::core::dequantize(record.data(), x.size(), DType::F32, format, as_f32.data());
    std::vector<unsigned char> back(x.size() * shardkit::core::dtype_size(c.dtype));
    shardkit::core::dequantize(record.data(), x.size(), c.dtype, format, back.data());
    for (size_t e = 0; e < x.size(); ++e) {
      const float widened = c.widen(back.data(), e);
      const float want = c.dtype == DType::F64 ? as_f32[e] : round_to(c.dtype, as_f32[e]);
      ASSERT_EQ(widened, want) << shardkit::core::dtype_name(c.dtype) << " element " << e;
    }
  }
}

TEST(Quantize, RefusesWhatItCannotDo) {
  float x[8] = {};
  unsigned char record[64];
  auto message = [&](QuantFormat format, DType dtype) {
    try {
      shardkit::core::quantize(x, 8, dtype, format, record);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({QuantBits::Exact, 256}, DType::F32), "shardkit quantize: the format is exact (nothing to quantize)");
  EXPECT_EQ(message({QuantBits::Int8, 4}, DType::F32),
            "shardkit quantize: block of 4 elements is outside [8, 1048576]");
  EXPECT_EQ(message({QuantBits::Int8, 256}, DType::I32),
            "shardkit quantize: dtype 'i32' cannot be quantized (f32, f64, f16, bf16 can)");
}

TEST(QuantizationScope, NestsAndRestores) {
  using shardkit::core::InterHostQuantization;
  EXPECT_TRUE(shardkit::core::current_quantization().exact());
  {
    shardkit::core::QuantizationScope outer(InterHostQuantization{{QuantBits::Int8, 256}, {QuantBits::Int4, 64}});
    EXPECT_EQ(shardkit::core::current_quantization().reduce, (QuantFormat{QuantBits::Int4, 64}));
    {
      shardkit::core::QuantizationScope inner(InterHostQuantization{});
      EXPECT_TRUE(shardkit::core::current_quantization().exact());
    }
    EXPECT_EQ(shardkit::core::current_quantization().gather, (QuantFormat{QuantBits::Int8, 256}));
  }
  EXPECT_TRUE(shardkit::core::current_quantization().exact());
}

}  // namespace

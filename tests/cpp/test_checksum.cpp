// core::crc32c_extend (the checksum of every checkpoint file) against published CRC32C values, and its two
// paths — the SSE4.2 instruction and the portable tables — against each other on random buffers of every
// length 0..300 from every start offset 0..15, and on long buffers that take the three-chain path.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/crc32c.h"

namespace {

using shardkit::core::crc32c_extend;
using shardkit::core::crc32c_extend_hardware;
using shardkit::core::crc32c_extend_portable;
using shardkit::core::crc32c_hardware_available;
using shardkit::core::crc32c_isa;

using Crc = uint32_t (*)(uint32_t, const void*, size_t);

struct Path {
  const char* name;
  Crc crc;
};

std::vector<Path> paths() {
  std::vector<Path> all{{"dispatched", &crc32c_extend}, {"portable", &crc32c_extend_portable}};
  if (crc32c_hardware_available()) all.push_back({"hardware", &crc32c_extend_hardware});
  return all;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 engine(seed);
  std::vector<uint8_t> bytes(n);
  for (auto& b : bytes) b = static_cast<uint8_t>(engine());
  return bytes;
}

TEST(Crc32c, KnownVectors) {
  // "123456789" is the catalogue's check value; the 32-byte buffers are RFC 3720's (iSCSI) B.4 examples.
  const std::string check = "123456789";
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), ascending(32), descending(32);
  for (int i = 0; i < 32; ++i) {
    ascending[i] = static_cast<uint8_t>(i);
    descending[i] = static_cast<uint8_t>(31 - i);
  }
  for (const Path& path : paths()) {
    SCOPED_TRACE(path.name);
    EXPECT_EQ(path.crc(0, check.data(), check.size()), 0xE3069283u);
    EXPECT_EQ(path.crc(0, zeros.data(), zeros.size()), 0x8A9136AAu);
    EXPECT_EQ(path.crc(0, ones.data(), ones.size()), 0x62A8AB43u);
    EXPECT_EQ(path.crc(0, ascending.data(), ascending.size()), 0x46DD794Eu);
    EXPECT_EQ(path.crc(0, descending.data(), descending.size()), 0x113FDB5Cu);
    EXPECT_EQ(path.crc(0, nullptr, 0), 0u);
    EXPECT_EQ(path.crc(0x12345678u, nullptr, 0), 0x12345678u);  // nothing added: unchanged
  }
}

TEST(Crc32c, DispatchesToTheHardwareWhereTheCpuHasIt) {
  EXPECT_STREQ(crc32c_isa(), crc32c_hardware_available() ? "sse4.2" : "portable");
  if (!crc32c_hardware_available()) {
    EXPECT_THROW(crc32c_extend_hardware(0, "x", 1), std::logic_error);
  }
}

TEST(Crc32c, PathsAgreeOnEveryLengthAndStart) {
  const std::vector<uint8_t> bytes = random_bytes(300 + 16, 7);
  for (size_t start = 0; start < 16; ++start) {
    for (size_t length = 0; length + start <= bytes.size() && length <= 300; ++length) {
      const uint8_t* p = bytes.data() + start;
      const uint32_t want = crc32c_extend_portable(0, p, length);
      for (const Path& path : paths()) {
        ASSERT_EQ(path.crc(0, p, length), want) << path.name << ": start " << start << ", length " << length;
      }
    }
  }
}

TEST(Crc32c, PathsAgreeOnLongBuffers) {
  // Around the three-chain thresholds (3 x 256 and 3 x 8192 bytes) and well past them, unaligned.
  const std::vector<uint8_t> bytes = random_bytes((1 << 20) + 64, 11);
  for (size_t length : {767u, 768u, 769u, 1000u, 24575u, 24576u, 24577u, 24576u + 768u + 7u, 100003u,
                        (1u << 20) + 13u}) {
    for (size_t start : {0u, 1u, 3u, 8u}) {
      const uint8_t* p = bytes.data() + start;
      const uint32_t want = crc32c_extend_portable(0, p, length);
      for (const Path& path : paths()) {
        ASSERT_EQ(path.crc(0, p, length), want) << path.name << ": start " << start << ", length " << length;
      }
    }
  }
}

TEST(Crc32c, ExtendingEqualsOneCallOverTheWhole) {
  // A stream's checksum, built write by write (as checkpoint files are), is the whole file's.
  const std::vector<uint8_t> bytes = random_bytes(200000, 3);
  std::mt19937 engine(5);
  for (const Path& path : paths()) {
    uint32_t running = 0;
    size_t done = 0;
    while (done < bytes.size()) {
      const size_t piece = std::min<size_t>(bytes.size() - done, engine() % 30000);
      running = path.crc(running, bytes.data() + done, piece);
      done += piece;
    }
    EXPECT_EQ(running, crc32c_extend_portable(0, bytes.data(), bytes.size())) << path.name;
  }
}

TEST(Crc32c, OneFlippedBitChangesTheChecksum) {
  std::vector<uint8_t> bytes = random_bytes(4096, 9);
  const uint32_t clean = crc32c_extend(0, bytes.data(), bytes.size());
  for (size_t bit : {0u, 1u, 8000u, 4096u * 8u - 1u}) {
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(crc32c_extend(0, bytes.data(), bytes.size()), clean) << "bit " << bit;
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

}  // namespace

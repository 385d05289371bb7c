// Mersenne Twister MT19937 with its state in the open, and numpy's legacy bounded draw.
//
// Why: torch's PowerSGD hook seeds its random Q matrices with `np.random.RandomState(random_seed)` and
// `torch.manual_seed(rng.randint(1_000_000_000))`. shardkit's C++ hook must draw the same seeds, and its
// checkpoints must carry the generator's state; numpy's RandomState is exactly MT19937 (the reference
// init_genrand seeding for a 32-bit seed) with a 624-word key and a position, which is what this struct
// holds, so a state can be handed to and from numpy's `RandomState.get_state()/set_state()` unchanged.
#pragma once

#include <array>
#include <cstdint>

namespace shardkit::core {

struct Mt19937 {
  static constexpr int kWords = 624;
  std::array<uint32_t, kWords> key{};
  int pos = kWords;  // next word of `key` to temper; kWords = regenerate first

  explicit Mt19937(uint32_t seed = 5489u) {
    key[0] = seed;
    for (int i = 1; i < kWords; ++i) {
      key[i] = 1812433253u * (key[i - 1] ^ (key[i - 1] >> 30)) + static_cast<uint32_t>(i);
    }
    pos = kWords;
  }

  uint32_t next_u32() {
    if (pos >= kWords) regenerate();
    uint32_t y = key[pos++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
  }

  // numpy's legacy RandomState.randint(high) for 0 < high <= 2^32: draws masked to the next power of two
  // minus one, rejecting those >= high.
  uint32_t randint(uint64_t high) {
    const uint32_t max = static_cast<uint32_t>(high - 1);
    uint32_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    uint32_t value;
    do {
      value = next_u32() & mask;
    } while (value > max);
    return value;
  }

 private:
  void regenerate() {
    constexpr int kShift = 397;
    for (int i = 0; i < kWords; ++i) {
      const uint32_t y = (key[i] & 0x80000000u) | (key[(i + 1) % kWords] & 0x7fffffffu);
      key[i] = key[(i + kShift) % kWords] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
    }
    pos = 0;
  }
};

}  // namespace shardkit::core

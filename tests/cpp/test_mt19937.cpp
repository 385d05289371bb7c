// core::Mt19937 against numpy's RandomState: the seeds shardkit's PowerSGD draws must be torch's (values
// printed by numpy 2.x: np.random.RandomState(seed).randint(1_000_000_000), ...).
#include <gtest/gtest.h>

#include <random>

#include "core/mt19937.h"

namespace {

using shardkit::core::Mt19937;

TEST(Mt19937, MatchesTheStandardEngine) {
  Mt19937 ours(12345u);
  std::mt19937 reference(12345u);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(ours.next_u32(), reference()) << "draw " << i;
}

TEST(Mt19937, RandintMatchesNumpyRandomState) {
  Mt19937 zero(0u);
  EXPECT_EQ(zero.randint(1000000000), 209652396u);
  EXPECT_EQ(zero.randint(1000000000), 398764591u);
  EXPECT_EQ(zero.randint(1000000000), 924231285u);
  EXPECT_EQ(Mt19937(11u).randint(1000000000), 774252441u);
  Mt19937 top(4294967295u);
  EXPECT_EQ(top.randint(1000000000), 419326371u);
  EXPECT_EQ(top.randint(7), 2u);  // a small bound: mask 7, draws of 7 rejected
}

TEST(Mt19937, StateRoundTripsThroughKeyAndPosition) {
  Mt19937 a(99u);
  for (int i = 0; i < 700; ++i) a.next_u32();  // past one regeneration
  Mt19937 b(1u);
  b.key = a.key;
  b.pos = a.pos;
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.next_u32(), b.next_u32()) << "draw " << i;
}

}  // namespace

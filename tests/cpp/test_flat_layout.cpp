// FlatLayout: offsets, alignment, padding, each rank's range and the (parameter, rank) pieces, checked
// against a brute-force element-by-element ownership map over many shapes and world sizes.
#include <gtest/gtest.h>

#include <stdexcept>
#include <tuple>
#include <vector>

#include "core/flat_layout.h"

using shardkit::core::FlatLayout;
using shardkit::core::FlatPiece;

TEST(FlatLayout, DrawingInTheHeader) {
  // a: 5, b: 3, c: 7 elements, alignment 2, world 4.
  FlatLayout layout({5, 3, 7}, 4, 2);
  EXPECT_EQ(layout.offsets(), (std::vector<int64_t>{0, 6, 10}));
  EXPECT_EQ(layout.used_numel(), 17);
  EXPECT_EQ(layout.param_numel(), 15);
  EXPECT_EQ(layout.shard_numel(), 6);  // ceil(17 / 4) = 5, rounded up to the alignment
  EXPECT_EQ(layout.padded_numel(), 24);
  EXPECT_EQ(layout.rank_begin(3), 18);
  // b lies in rank 1's range [6, 12) entirely; c straddles ranks 1 and 2.
  FlatPiece b = layout.piece(1, 1);
  EXPECT_EQ(std::make_tuple(b.param_begin, b.flat_begin, b.shard_begin, b.numel), std::make_tuple(0, 6, 0, 3));
  auto c = layout.pieces_of_param(2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(std::make_tuple(c[0].rank, c[0].param_begin, c[0].shard_begin, c[0].numel), std::make_tuple(1, 0, 4, 2));
  EXPECT_EQ(std::make_tuple(c[1].rank, c[1].param_begin, c[1].shard_begin, c[1].numel), std::make_tuple(2, 2, 0, 5));
  EXPECT_TRUE(layout.pieces_of_rank(3).empty());  // only padding
  EXPECT_EQ(layout.owned_numel(3), 0);
}

TEST(FlatLayout, EmptyAndZeroSizedParameters) {
  FlatLayout none({}, 3);
  EXPECT_EQ(none.shard_numel(), 0);
  EXPECT_TRUE(none.pieces_of_rank(2).empty());
  FlatLayout zeros({0, 4, 0}, 2);
  EXPECT_EQ(zeros.offsets(), (std::vector<int64_t>{0, 0, 4}));
  EXPECT_TRUE(zeros.pieces_of_param(0).empty());
  EXPECT_EQ(zeros.piece(2, 1).numel, 0);
}

TEST(FlatLayout, RefusesBadArguments) {
  EXPECT_THROW(FlatLayout({1}, 0), std::invalid_argument);
  EXPECT_THROW(FlatLayout({1}, 2, 0), std::invalid_argument);
  EXPECT_THROW(FlatLayout({-1}, 2), std::invalid_argument);
  FlatLayout layout({4}, 2);
  EXPECT_THROW(layout.piece(1, 0), std::out_of_range);
  EXPECT_THROW(layout.piece(0, 2), std::out_of_range);
}

class FlatLayoutOwnership : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

// Every element of every parameter is owned by exactly one piece, the piece's three coordinates agree, and
// each rank's pieces are in flat order inside its range.
TEST_P(FlatLayoutOwnership, EveryElementOnceWithConsistentCoordinates) {
  const auto [world, alignment] = GetParam();
  const std::vector<std::vector<int64_t>> models = {
      {1}, {7}, {3, 1, 4, 1, 5, 9, 2, 6}, {1000, 1, 1, 17}, {0, 12, 0, 13}, {64, 64, 64}};
  for (const auto& numels : models) {
    FlatLayout layout(numels, world, alignment);
    EXPECT_EQ(layout.shard_numel() % alignment, 0);
    EXPECT_GE(layout.padded_numel(), layout.used_numel());
    EXPECT_LT(layout.padded_numel() - layout.used_numel(), static_cast<int64_t>(world) * alignment + world);
    std::vector<std::vector<int>> owner(numels.size());
    for (size_t p = 0; p < numels.size(); ++p) {
      EXPECT_EQ(layout.offsets()[p] % alignment, 0);
      if (p > 0) {
        EXPECT_GE(layout.offsets()[p], layout.offsets()[p - 1] + numels[p - 1]);
      }
      owner[p].assign(static_cast<size_t>(numels[p]), -1);
    }
    int64_t owned_total = 0;
    for (int r = 0; r < world; ++r) {
      int64_t previous_end = 0;
      for (const FlatPiece& piece : layout.pieces_of_rank(r)) {
        EXPECT_EQ(piece.rank, r);
        EXPECT_EQ(piece.flat_begin, layout.offsets()[piece.param] + piece.param_begin);
        EXPECT_EQ(piece.shard_begin, piece.flat_begin - layout.rank_begin(r));
        EXPECT_GE(piece.shard_begin, previous_end);
        EXPECT_LE(piece.shard_begin + piece.numel, layout.shard_numel());
        previous_end = piece.shard_begin + piece.numel;
        for (int64_t e = 0; e < piece.numel; ++e) {
          int& who = owner[piece.param][static_cast<size_t>(piece.param_begin + e)];
          EXPECT_EQ(who, -1) << "element owned twice";
          who = r;
        }
      }
      owned_total += layout.owned_numel(r);
    }
    EXPECT_EQ(owned_total, layout.param_numel());
    for (size_t p = 0; p < numels.size(); ++p) {
      for (int64_t e = 0; e < numels[p]; ++e) {
        const int64_t flat = layout.offsets()[p] + e;
        EXPECT_EQ(owner[p][static_cast<size_t>(e)], static_cast<int>(flat / layout.shard_numel()));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndAlignment, FlatLayoutOwnership,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 7, 16), ::testing::Values(1, 4, 16)));

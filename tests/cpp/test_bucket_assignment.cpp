#include <gtest/gtest.h>

#include "core/bucket_assignment.h"

using shardkit::core::assign_buckets;
using shardkit::core::BucketParam;
using Buckets = std::vector<std::vector<size_t>>;

TEST(BucketAssignment, SmallFirstBucketThenCap) {
  // Six 400-byte parameters visited in reverse: first bucket closes at >= 500 bytes, then at >= 1000.
  std::vector<BucketParam> params(6, BucketParam{400, 0});
  EXPECT_EQ(assign_buckets(params, {5, 4, 3, 2, 1, 0}, 500, 1000), (Buckets{{5, 4}, {3, 2, 1}, {0}}));
}

TEST(BucketAssignment, GroupsNeverMixAndBucketsFollowFirstMember) {
  std::vector<BucketParam> params{{100, 0}, {100, 1}, {100, 0}, {100, 1}};
  EXPECT_EQ(assign_buckets(params, {3, 2, 1, 0}, 1000, 1000), (Buckets{{3, 1}, {2, 0}}));
}

TEST(BucketAssignment, OneBucketPerParameterWhenCapIsTiny) {
  std::vector<BucketParam> params(3, BucketParam{8, 0});
  EXPECT_EQ(assign_buckets(params, {2, 0, 1}, 1, 1), (Buckets{{2}, {0}, {1}}));
}

TEST(BucketAssignment, RejectsOrdersThatAreNotPermutations) {
  std::vector<BucketParam> params(2, BucketParam{8, 0});
  EXPECT_THROW(assign_buckets(params, {0, 0}, 1, 1), std::invalid_argument);
  EXPECT_THROW(assign_buckets(params, {0}, 1, 1), std::invalid_argument);
}

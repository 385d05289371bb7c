// Gradient bucket assignment for data-parallel reducers, torch-free.
//
// Parameters are visited in `order` (a DDP reducer passes reverse registration order, or the order in
// which gradients arrived in the first iteration). Each group (one dtype on one device) fills its own open
// bucket; a bucket closes once it holds at least its size limit: `first_limit_bytes` for a group's first
// bucket — small, so that the first reduction starts early in backward — and `limit_bytes` after that.
// Buckets are numbered in the order they would become ready: by the position in `order` of their first
// parameter. Every parameter lands in exactly one bucket, in visiting order within it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardkit::core {

struct BucketParam {
  size_t bytes = 0;
  int64_t group = 0;  // parameters of different groups never share a bucket
};

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                                size_t first_limit_bytes, size_t limit_bytes);

}  // namespace shardkit::core

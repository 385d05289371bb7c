#include "core/bucket_assignment.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace shardkit::core {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                                size_t first_limit_bytes, size_t limit_bytes) {
  if (order.size() != params.size()) {
    throw std::invalid_argument("assign_buckets: order has " + std::to_string(order.size()) + " entries for " +
                                std::to_string(params.size()) + " parameters");
  }
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    bool closed_one = false;  // the group already closed its first (small) bucket
  };
  std::map<int64_t, Open> open;
  std::vector<std::vector<size_t>> buckets;
  std::vector<bool> seen(params.size(), false);
  for (size_t index : order) {
    if (index >= params.size() || seen[index]) {
      throw std::invalid_argument("assign_buckets: order is not a permutation (entry " + std::to_string(index) + ")");
    }
    seen[index] = true;
    Open& bucket = open[params[index].group];
    bucket.members.push_back(index);
    bucket.bytes += params[index].bytes;
    if (bucket.bytes >= (bucket.closed_one ? limit_bytes : first_limit_bytes)) {
      buckets.push_back(std::move(bucket.members));
      bucket.members.clear();
      bucket.bytes = 0;
      bucket.closed_one = true;
    }
  }
  for (auto& [group, bucket] : open) {
    if (!bucket.members.empty()) buckets.push_back(std::move(bucket.members));
  }
  std::vector<size_t> position(params.size());
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::stable_sort(buckets.begin(), buckets.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return buckets;
}

}  // namespace shardkit::core

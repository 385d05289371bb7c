#include "ddp/gradient_shards.h"

#include <algorithm>

namespace shardkit::ddp {

GradientShards::GradientShards(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                               std::vector<at::Tensor> shards, std::vector<int64_t> space,
                               std::vector<int64_t> flat_offset, int rank, int world, const std::string& where)
    : shards_(std::move(shards)), places_(params.size()), defined_(params.size(), false), rank_(rank) {
  TORCH_CHECK(space.size() == params.size() && flat_offset.size() == params.size(), where, "the gradient-shard "
              "layout covers ", space.size(), " parameters, the reducer has ", params.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const at::Tensor& shard = shards_[s];
    TORCH_CHECK(shard.dim() == 1 && shard.is_contiguous(), where, "gradient shard ", s,
                " must be a flat contiguous tensor, got sizes ", shard.sizes());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(space[i] >= 0 && static_cast<size_t>(space[i]) < shards_.size(), where, "parameter ", names[i],
                " is placed in flat space ", space[i], " of ", shards_.size());
    const at::Tensor& shard = shards_[static_cast<size_t>(space[i])];
    const int64_t numel = params[i].numel();
    TORCH_CHECK(shard.scalar_type() == params[i].scalar_type() && shard.device() == params[i].device(), where,
                "parameter ", names[i], " (", params[i].scalar_type(), " on ", params[i].device(),
                ") is placed in a gradient shard of ", shard.scalar_type(), " on ", shard.device());
    TORCH_CHECK(flat_offset[i] >= 0 && flat_offset[i] + numel <= shard.numel() * world, where, "parameter ",
                names[i], " at flat offset ", flat_offset[i], " (", numel, " elements) lies outside its space of ",
                world, " x ", shard.numel(), " elements");
    places_[i] = {static_cast<size_t>(space[i]), flat_offset[i], numel};
  }
}

void GradientShards::sort_members(std::vector<size_t>& members) const {
  std::stable_sort(members.begin(), members.end(),
                   [this](size_t a, size_t b) { return places_[a].flat_offset < places_[b].flat_offset; });
}

std::vector<GradientShards::OwnerRange> GradientShards::owner_ranges(const std::vector<size_t>& members,
                                                                     const std::vector<size_t>& offsets,
                                                                     const std::vector<size_t>& lengths) const {
  // Members sorted by flat offset: the owner of successive bucket elements never decreases, so every
  // owner's elements are one run. Walk the members, cutting each at shard boundaries.
  std::vector<OwnerRange> ranges;
  for (size_t position = 0; position < members.size(); ++position) {
    const Place& place = places_[members[position]];
    const int64_t shard = shards_[place.space].numel();
    int64_t flat = place.flat_offset;
    const int64_t end = place.flat_offset + static_cast<int64_t>(lengths[position]);
    while (flat < end) {
      const int owner = static_cast<int>(flat / shard);
      const int64_t piece = std::min(end, (owner + 1) * shard) - flat;
      const size_t begin = offsets[position] + static_cast<size_t>(flat - place.flat_offset);
      if (!ranges.empty() && ranges.back().rank == owner) {
        TORCH_INTERNAL_ASSERT(ranges.back().begin + ranges.back().length == begin, "bucket members are not packed");
        ranges.back().length += static_cast<size_t>(piece);
      } else {
        TORCH_INTERNAL_ASSERT(ranges.empty() || ranges.back().rank < owner, "bucket members are not sorted");
        ranges.push_back({owner, begin, static_cast<size_t>(piece)});
      }
      flat += piece;
    }
  }
  return ranges;
}

void GradientShards::take(size_t index, const at::Tensor& reduced, const at::Tensor& divisor) {
  const Place& place = places_[index];
  at::Tensor& shard = shards_[place.space];
  const int64_t lo = rank_ * shard.numel();
  const int64_t first = std::max(place.flat_offset, lo);
  const int64_t last = std::min(place.flat_offset + place.numel, lo + shard.numel());
  if (first < last) {
    const at::Tensor source = reduced.narrow(0, first - place.flat_offset, last - first);
    at::Tensor target = shard.narrow(0, first - lo, last - first);
    if (!defined_[index]) {
      if (divisor.defined()) {
        at::div_out(target, source, divisor);
      } else {
        target.copy_(source);
      }
    } else {
      target.add_(divisor.defined() ? source.div(divisor) : source);
    }
  }
  defined_[index] = true;
}

void GradientShards::clear(bool set_to_none) {
  if (set_to_none) {
    std::fill(defined_.begin(), defined_.end(), false);
  } else {
    for (auto& shard : shards_) shard.zero_();
  }
}

}  // namespace shardkit::ddp

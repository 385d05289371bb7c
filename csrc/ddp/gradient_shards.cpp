#include "ddp/gradient_shards.h"

#include <algorithm>

namespace shardkit::ddp {

GradientShards::GradientShards(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                               std::vector<core::FlatLayout> layouts, std::vector<at::Tensor> shards,
                               std::vector<int64_t> space, std::vector<int64_t> slot, int rank, int world,
                               const std::string& where)
    : layouts_(std::move(layouts)),
      shards_(std::move(shards)),
      places_(params.size()),
      defined_(params.size(), false),
      rank_(rank) {
  TORCH_CHECK(layouts_.size() == shards_.size(), where, "the gradient-shard partition has ", layouts_.size(),
              " flat layouts but ", shards_.size(), " shards");
  TORCH_CHECK(space.size() == params.size() && slot.size() == params.size(), where, "the gradient-shard "
              "partition places ", space.size(), " parameters, the reducer has ", params.size());
  std::vector<std::vector<int>> taken(layouts_.size());
  for (size_t s = 0; s < layouts_.size(); ++s) {
    const core::FlatLayout& layout = layouts_[s];
    const at::Tensor& shard = shards_[s];
    TORCH_CHECK(layout.world() == world, where, "flat layout ", s, " spans ", layout.world(),
                " ranks, the process group has ", world);
    TORCH_CHECK(shard.dim() == 1 && shard.is_contiguous() && shard.numel() == layout.shard_numel(), where,
                "gradient shard ", s, " must be a flat contiguous tensor of ", layout.shard_numel(),
                " elements (its layout's shard), got sizes ", shard.sizes());
    taken[s].assign(layout.num_params(), -1);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(space[i] >= 0 && static_cast<size_t>(space[i]) < layouts_.size(), where, "parameter ", names[i],
                " is placed in flat space ", space[i], " of ", layouts_.size());
    const auto s = static_cast<size_t>(space[i]);
    const core::FlatLayout& layout = layouts_[s];
    TORCH_CHECK(slot[i] >= 0 && static_cast<size_t>(slot[i]) < layout.num_params(), where, "parameter ", names[i],
                " is placed at slot ", slot[i], " of flat space ", s, ", which holds ", layout.num_params(),
                " parameters");
    const auto k = static_cast<size_t>(slot[i]);
    TORCH_CHECK(taken[s][k] < 0, where, "parameters ", names[static_cast<size_t>(taken[s][k])], " and ", names[i],
                " are both placed at slot ", k, " of flat space ", s);
    taken[s][k] = static_cast<int>(i);
    const at::Tensor& shard = shards_[s];
    TORCH_CHECK(shard.scalar_type() == params[i].scalar_type() && shard.device() == params[i].device(), where,
                "parameter ", names[i], " (", params[i].scalar_type(), " on ", params[i].device(),
                ") is placed in a gradient shard of ", shard.scalar_type(), " on ", shard.device());
    TORCH_CHECK(layout.numels()[k] == params[i].numel(), where, "parameter ", names[i], " has ", params[i].numel(),
                " elements but slot ", k, " of flat space ", s, " has ", layout.numels()[k]);
    places_[i] = {s, k};
  }
  for (size_t s = 0; s < layouts_.size(); ++s) {
    const auto empty = std::find(taken[s].begin(), taken[s].end(), -1);
    TORCH_CHECK(empty == taken[s].end(), where, "slot ", empty - taken[s].begin(), " of flat space ", s,
                " holds no parameter of the reducer");
  }
}

void GradientShards::sort_members(std::vector<size_t>& members) const {
  std::stable_sort(members.begin(), members.end(),
                   [this](size_t a, size_t b) { return flat_offset(a) < flat_offset(b); });
}

std::vector<GradientShards::OwnerRange> GradientShards::owner_ranges(const std::vector<size_t>& members,
                                                                     const std::vector<size_t>& offsets,
                                                                     const std::vector<size_t>& lengths) const {
  // Members sorted by flat offset: the owner of successive bucket elements never decreases, so every
  // owner's elements are one run. Each member contributes its layout pieces (one per owning rank, in rank
  // order); consecutive pieces of one owner merge.
  std::vector<OwnerRange> ranges;
  for (size_t position = 0; position < members.size(); ++position) {
    const Place& place = places_[members[position]];
    const core::FlatLayout& layout = layouts_[place.space];
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(lengths[position]) == layout.numels()[place.slot],
                          "bucket member length differs from its flat-layout numel");
    for (const core::FlatPiece& piece : layout.pieces_of_param(place.slot)) {
      const size_t begin = offsets[position] + static_cast<size_t>(piece.param_begin);
      const auto length = static_cast<size_t>(piece.numel);
      if (!ranges.empty() && ranges.back().rank == piece.rank) {
        TORCH_INTERNAL_ASSERT(ranges.back().begin + ranges.back().length == begin, "bucket members are not packed");
        ranges.back().length += length;
      } else {
        TORCH_INTERNAL_ASSERT(ranges.empty() || ranges.back().rank < piece.rank, "bucket members are not sorted");
        ranges.push_back({piece.rank, begin, length});
      }
    }
  }
  return ranges;
}

void GradientShards::take(size_t index, const at::Tensor& reduced, const at::Tensor& divisor) {
  const Place& place = places_[index];
  const core::FlatPiece piece = layouts_[place.space].piece(place.slot, rank_);
  if (piece.numel > 0) {
    const at::Tensor source = reduced.narrow(0, piece.param_begin, piece.numel);
    at::Tensor target = shards_[place.space].narrow(0, piece.shard_begin, piece.numel);
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

// GradientShards: where the reducer puts gradients under ZeRO-2 (zero_stage=2).
//
// The partition is the DDP's (shardkit.DistributedDataParallel(zero_stage=2), python/shardkit/ddp.py), and
// its geometry is core::FlatLayout's, the one flat layout of shardkit: per dtype ("space") one layout over
// the trainable parameters of that dtype, rank r owning [r·S, (r+1)·S) of it. Reducer parameter i is
// parameter `slot[i]` of layout `space[i]`; this rank's gradient shard of space s is `shards[s]`, a flat
// tensor of S elements that the optimizer steps from. No offset or shard arithmetic lives here: every
// "which elements does rank r own" question is a FlatLayout piece.
//
// Promise: once the reducer has handed every bucket's reduced gradients to take(), each shard holds the
// owned elements of every parameter's averaged gradient, written if the parameter had no gradient since
// the last clear() and added otherwise (the accumulation .grad would have done). Elements this rank does
// not own are never stored, so gradient memory between steps is 1/N of the model's (plus padding).
//
// A bucket's members ordered by flat offset (sort_members) make each rank's share of the bucket one
// contiguous range (owner_ranges), reduced to that rank with a single `reduce`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/flat_layout.h"

namespace shardkit::ddp {

class GradientShards {
 public:
  struct OwnerRange {
    int rank = 0;
    size_t begin = 0;   // first element of the bucket owned by `rank`
    size_t length = 0;  // elements
  };

  // Validates the partition against the parameters and the process group (TORCH_CHECK naming `where`, the
  // parameter and the value): every layout spans `world` ranks, every shard has its layout's S elements,
  // dtype and device, and every (space, slot) is taken by exactly one parameter of that slot's numel.
  GradientShards(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                 std::vector<core::FlatLayout> layouts, std::vector<at::Tensor> shards, std::vector<int64_t> space,
                 std::vector<int64_t> slot, int rank, int world, const std::string& where);

  // Orders a bucket's members (parameter indices, one dtype) by their place in the flat space.
  void sort_members(std::vector<size_t>& members) const;
  // Each owner's contiguous range of a bucket whose members are sorted and packed at `offsets`.
  std::vector<OwnerRange> owner_ranges(const std::vector<size_t>& members, const std::vector<size_t>& offsets,
                                       const std::vector<size_t>& lengths) const;

  // Takes parameter `index`'s reduced gradient (flat, all of its elements; divided by `divisor` on the way
  // when `divisor` is defined) into the owned part of its shard.
  void take(size_t index, const at::Tensor& reduced, const at::Tensor& divisor);
  // Per parameter: whether it holds a gradient since the last clear().
  const std::vector<bool>& defined() const { return defined_; }
  // optimizer.zero_grad(): forget the gradients (set_to_none) or zero them.
  void clear(bool set_to_none);

 private:
  struct Place {
    size_t space = 0;
    size_t slot = 0;  // the parameter's index in its space's layout
  };
  int64_t flat_offset(size_t index) const {
    return layouts_[places_[index].space].offsets()[places_[index].slot];
  }

  std::vector<core::FlatLayout> layouts_;
  std::vector<at::Tensor> shards_;
  std::vector<Place> places_;  // per parameter
  std::vector<bool> defined_;  // per parameter
  int rank_ = 0;
};

}  // namespace shardkit::ddp

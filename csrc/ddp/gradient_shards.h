// GradientShards: where the reducer puts gradients under ZeRO-2 (zero_stage=2).
//
// The partition is the optimizer's (shardkit.ZeroRedundancyOptimizer, python/shardkit/zero.py): per dtype
// one flat index space of N·S elements holding the trainable parameters one after another (then padding),
// rank r owning elements [r·S, (r+1)·S). Parameter i occupies [flat_offset[i], flat_offset[i] + numel) of
// space `space[i]`; this rank's gradient shard of space s is `shards[s]`, a flat tensor of S elements that
// the optimizer steps from.
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

namespace shardkit::ddp {

class GradientShards {
 public:
  struct OwnerRange {
    int rank = 0;
    size_t begin = 0;   // first element of the bucket owned by `rank`
    size_t length = 0;  // elements
  };

  // Validates the layout against the parameters (TORCH_CHECK naming `where`, the parameter and the value).
  GradientShards(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                 std::vector<at::Tensor> shards, std::vector<int64_t> space, std::vector<int64_t> flat_offset,
                 int rank, int world, const std::string& where);

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
    int64_t flat_offset = 0;
    int64_t numel = 0;
  };
  std::vector<at::Tensor> shards_;
  std::vector<Place> places_;  // per parameter
  std::vector<bool> defined_;  // per parameter
  int rank_ = 0;
};

}  // namespace shardkit::ddp

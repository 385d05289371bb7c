// FlatLayout: the one flat-parameter layout of shardkit, shared by ZeRO-1/2 (csrc/ddp) and FSDP (csrc/fsdp).
//
// Parameters of one dtype are laid out one after another in a flat index space; each starts at a multiple
// of `alignment` elements (alignment 1: no gaps). The space is padded to world · S elements, S the shard
// size (a multiple of `alignment` too, so every rank's shard starts aligned), and rank r owns
// [r·S, (r+1)·S):
//
//     parameters:     | a a a a a |·| b b b |···| c c c c c c c |pad....|
//     flat offsets:   0           6           12                      world·S
//     ranks:          |  rank 0   |  rank 1   |  rank 2   |  rank 3   |
//
// A piece is the overlap of one parameter with one rank's range: where it lies in the parameter (the
// parameter's flattened element index), in the flat space and in the rank's shard. A parameter can span
// several ranks; a rank can hold no piece at all (few elements, many ranks). Gaps and padding belong to no
// parameter: they hold zeros by convention and never carry optimizer state.
//
// Promise: the layout is a pure function of (numels, world, alignment), so every rank computes the same
// layout from the same parameters without communicating. Plain integers in, plain integers out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardkit::core {

struct FlatPiece {
  size_t param = 0;         // index of the parameter
  int rank = 0;             // the rank that owns it
  int64_t param_begin = 0;  // first element in the flattened parameter
  int64_t flat_begin = 0;   // first element in the flat space (= offset[param] + param_begin)
  int64_t shard_begin = 0;  // first element in the rank's shard (= flat_begin - rank · S)
  int64_t numel = 0;        // elements; 0 for an empty piece
};

class FlatLayout {
 public:
  FlatLayout() = default;
  // Throws std::invalid_argument for world < 1, alignment < 1 or a negative numel.
  FlatLayout(std::vector<int64_t> numels, int world, int64_t alignment = 1);

  int world() const { return world_; }
  int64_t alignment() const { return alignment_; }
  size_t num_params() const { return numels_.size(); }
  const std::vector<int64_t>& numels() const { return numels_; }
  // Each parameter's first element in the flat space (aligned).
  const std::vector<int64_t>& offsets() const { return offsets_; }
  // End of the last parameter: the elements the all-gathered buffer must hold for the views.
  int64_t used_numel() const { return used_numel_; }
  // Sum of the parameters' elements (no gaps, no padding).
  int64_t param_numel() const { return param_numel_; }
  int64_t shard_numel() const { return shard_numel_; }            // S
  int64_t padded_numel() const { return shard_numel_ * world_; }  // world · S

  // [begin, end) of `rank`'s range in the flat space.
  int64_t rank_begin(int rank) const;
  int64_t rank_end(int rank) const { return rank_begin(rank) + shard_numel_; }

  // The overlap of parameter `param` with `rank`'s range (numel 0 if none; then param_begin and
  // shard_begin are clamped to where the overlap would start).
  FlatPiece piece(size_t param, int rank) const;
  // `rank`'s non-empty pieces, in flat order.
  std::vector<FlatPiece> pieces_of_rank(int rank) const;
  // `param`'s non-empty pieces, by rank.
  std::vector<FlatPiece> pieces_of_param(size_t param) const;
  // Elements of `rank`'s shard that belong to parameters (the rest is gaps and padding).
  int64_t owned_numel(int rank) const;

 private:
  void check_rank(int rank) const;
  void check_param(size_t param) const;

  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;
  int world_ = 1;
  int64_t alignment_ = 1;
  int64_t used_numel_ = 0;
  int64_t param_numel_ = 0;
  int64_t shard_numel_ = 0;
};

}  // namespace shardkit::core

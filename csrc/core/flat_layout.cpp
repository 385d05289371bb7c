#include "core/flat_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace shardkit::core {

namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

FlatLayout::FlatLayout(std::vector<int64_t> numels, int world, int64_t alignment)
    : numels_(std::move(numels)), world_(world), alignment_(alignment) {
  if (world < 1) throw std::invalid_argument("FlatLayout: world size must be at least 1, got " + std::to_string(world));
  if (alignment < 1) throw std::invalid_argument("FlatLayout: alignment must be at least 1, got " + std::to_string(alignment));
  offsets_.reserve(numels_.size());
  int64_t cursor = 0;
  for (size_t i = 0; i < numels_.size(); ++i) {
    if (numels_[i] < 0) {
      throw std::invalid_argument("FlatLayout: parameter " + std::to_string(i) + " has negative numel " +
                                  std::to_string(numels_[i]));
    }
    cursor = round_up(cursor, alignment_);
    offsets_.push_back(cursor);
    cursor += numels_[i];
    param_numel_ += numels_[i];
  }
  used_numel_ = cursor;
  shard_numel_ = round_up((used_numel_ + world_ - 1) / world_, alignment_);
}

void FlatLayout::check_rank(int rank) const {
  if (rank < 0 || rank >= world_) {
    throw std::out_of_range("FlatLayout: rank " + std::to_string(rank) + " outside the world of " +
                            std::to_string(world_));
  }
}

void FlatLayout::check_param(size_t param) const {
  if (param >= numels_.size()) {
    throw std::out_of_range("FlatLayout: parameter " + std::to_string(param) + " of " +
                            std::to_string(numels_.size()));
  }
}

int64_t FlatLayout::rank_begin(int rank) const {
  check_rank(rank);
  return static_cast<int64_t>(rank) * shard_numel_;
}

FlatPiece FlatLayout::piece(size_t param, int rank) const {
  check_param(param);
  const int64_t lo = rank_begin(rank);
  const int64_t hi = lo + shard_numel_;
  const int64_t first = std::clamp(offsets_[param], lo, hi);
  const int64_t last = std::clamp(offsets_[param] + numels_[param], lo, hi);
  FlatPiece piece;
  piece.param = param;
  piece.rank = rank;
  piece.flat_begin = first;
  piece.numel = std::max<int64_t>(0, last - first);
  piece.param_begin = std::clamp<int64_t>(first - offsets_[param], 0, numels_[param]);
  piece.shard_begin = first - lo;
  return piece;
}

std::vector<FlatPiece> FlatLayout::pieces_of_rank(int rank) const {
  check_rank(rank);
  std::vector<FlatPiece> pieces;
  for (size_t p = 0; p < numels_.size(); ++p) {
    FlatPiece piece = this->piece(p, rank);
    if (piece.numel > 0) pieces.push_back(piece);
  }
  return pieces;
}

std::vector<FlatPiece> FlatLayout::pieces_of_param(size_t param) const {
  check_param(param);
  std::vector<FlatPiece> pieces;
  for (int r = 0; r < world_; ++r) {
    FlatPiece piece = this->piece(param, r);
    if (piece.numel > 0) pieces.push_back(piece);
  }
  return pieces;
}

int64_t FlatLayout::owned_numel(int rank) const {
  int64_t owned = 0;
  for (const FlatPiece& piece : pieces_of_rank(rank)) owned += piece.numel;
  return owned;
}

}  // namespace shardkit::core

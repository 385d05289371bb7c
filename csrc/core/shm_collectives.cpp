// The collective algorithms of ShmGroup, each a sequence of rounds over the slot buffers (see
// shm_group.h for the round/sync protocol). Every op is chunked by the slot size, so any size works.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "core/reduce.h"
#include "core/shm_group.h"

namespace shardkit::core {

namespace {

// Up to this many bytes, allreduce/reduce use one round in which every rank reduces all slots (one sync,
// N-fold reads). Above it, the two-step reduce-scatter + all-gather round reads each byte about once.
constexpr size_t kSmallReduceBytes = 32 * 1024;
// Sub-slices of the reduce-scatter step start on 64-byte boundaries (whole cache lines per rank).
constexpr size_t kSliceAlignBytes = 64;

struct Slice {
  size_t begin;
  size_t end;
};

// Rank r's share of n elements when n is split over `parts` ranks in aligned pieces.
Slice share(size_t n, int parts, int r, size_t elem) {
  const size_t align = std::max<size_t>(1, kSliceAlignBytes / elem);
  size_t per = (n + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  const size_t begin = std::min(n, per * r);
  return {begin, std::min(n, begin + per)};
}

// Reduces `count` elements of every rank's `sources` (in rank order) into `into`, then divides them by `divisor`
// (an AVG) — the one place a reduction's element is formed, whatever path the op takes.
void reduce_slice(void* into, const std::vector<const void*>& sources, size_t count, DType dtype, ReduceOp op,
                  int64_t divisor) {
  reduce_into(into, sources.data(), static_cast<int>(sources.size()), count, dtype, op);
  if (divisor > 1) divide_in_place(into, count, dtype, divisor);
}

}  // namespace

void ShmGroup::barrier(const CallInfo& call) { sync(begin(OpKind::Barrier, 0, DType::U8, -1, ReduceOp::Sum, call)); }

void ShmGroup::broadcast(void* data, size_t count, DType dtype, int root, const CallInfo& call) {
  const OpHeader header = begin(OpKind::Broadcast, count, dtype, root, ReduceOp::Sum, call);
  const size_t elem = dtype_size(dtype);
  const size_t chunk = slot_bytes_ / elem;
  auto* bytes = static_cast<uint8_t*>(data);
  size_t offset = 0;
  do {  // at least one round, so that even empty ops check agreement
    const size_t n = std::min(chunk, count - offset);
    const uint64_t round = rounds_++;
    if (rank_ == root) std::memcpy(slot(root, round), bytes + offset * elem, n * elem);
    sync(header);
    if (rank_ != root) std::memcpy(bytes + offset * elem, slot(root, round), n * elem);
    offset += n;
  } while (offset < count);
}

void ShmGroup::reduce_round(const OpHeader& header, const uint8_t* in, uint8_t* out, size_t count, size_t elem,
                            bool copy_out, int64_t divisor) {
  const uint64_t round = rounds_++;
  std::vector<const void*>& sources = sources_;  // one per rank
  if (size_ == 1) {
    // Nobody to exchange with: the result is the reduction of this rank's input alone, formed in one pass
    // from `in` to `out` instead of through the slot and back (the same element function, so the same bits: a
    // bool becomes 0 or 1, an AVG divides). reduce_into takes `out == in` as it is and refuses a partial overlap,
    // which no caller makes (allreduce passes one buffer or two distinct ones).
    if (copy_out) {
      sources[0] = in;
      reduce_slice(out, sources, count, header.dtype, header.reduce_op, divisor);
    }
    return;
  }
  std::memcpy(slot(rank_, round), in, count * elem);
  sync(header);
  if (count * elem <= kSmallReduceBytes) {
    // Every rank reduces everything, in rank order: one sync, identical bits everywhere.
    if (copy_out) {
      for (int r = 0; r < size_; ++r) sources[r] = slot(r, round);
      reduce_slice(out, sources, count, header.dtype, header.reduce_op, divisor);
    }
    return;
  }
  // Reduce-scatter: this rank reduces its slice of all slots into its own slot (others read only their
  // own slices, so the writes are disjoint from every concurrent read). Then everyone gathers the slices.
  const Slice mine = share(count, size_, rank_, elem);
  for (int r = 0; r < size_; ++r) sources[r] = slot(r, round) + mine.begin * elem;
  reduce_slice(slot(rank_, round) + mine.begin * elem, sources, mine.end - mine.begin, header.dtype, header.reduce_op,
               divisor);
  sync(header);
  if (!copy_out) return;
  for (int r = 0; r < size_; ++r) {
    const Slice theirs = share(count, size_, r, elem);
    std::memcpy(out + theirs.begin * elem, slot(r, round) + theirs.begin * elem, (theirs.end - theirs.begin) * elem);
  }
}

void ShmGroup::allreduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, const CallInfo& call) {
  allreduce_impl(in, out, count, dtype, op, 1, call);
}

void ShmGroup::allreduce_average(const void* in, void* out, size_t count, DType dtype, int64_t divisor,
                                 const CallInfo& call) {
  if (divisor < 1 || divisor > UINT32_MAX) {
    throw std::invalid_argument("shardkit shm: allreduce_average divisor must be in [1, 2^32), got " +
                                std::to_string(divisor));
  }
  allreduce_impl(in, out, count, dtype, ReduceOp::Sum, divisor, call);
}

void ShmGroup::allreduce_impl(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int64_t divisor,
                              const CallInfo& call) {
  const size_t elem = dtype_size(dtype);
  if (in == out && count * elem > kSmallReduceBytes && !shared_.empty()) {
    size_t offset = 0;
    if (std::shared_ptr<SharedBuffer> buffer = find_shared(out, count * elem, &offset)) {
      allreduce_shared(*buffer, offset, count, dtype, op, divisor, call);
      return;
    }
  }
  OpHeader header = begin(OpKind::AllReduce, count, dtype, -1, op, call);
  header.divide_by = static_cast<uint32_t>(divisor);
  const size_t chunk = slot_bytes_ / elem;
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk, count - offset);
    reduce_round(header, static_cast<const uint8_t*>(in) + offset * elem, static_cast<uint8_t*>(out) + offset * elem,
                 n, elem, true, divisor);
    offset += n;
  } while (offset < count);
}

OpHeader ShmGroup::begin_shared(OpKind kind, SharedBuffer& buffer, size_t offset, size_t count, DType dtype,
                                ReduceOp op, const CallInfo& call) {
  OpHeader header = begin(kind, count, dtype, -1, op, call);
  header.shared = 1;
  header.shared_id = buffer.id_;
  header.shared_offset = offset;
  return header;
}

void ShmGroup::allreduce_shared(SharedBuffer& buffer, size_t offset, size_t count, DType dtype, ReduceOp op,
                                int64_t divisor, const CallInfo& call) {
  OpHeader header = begin_shared(OpKind::AllReduce, buffer, offset, count, dtype, op, call);
  header.divide_by = static_cast<uint32_t>(divisor);
  const size_t elem = dtype_size(dtype);
  auto at = [&](int r, size_t element) { return buffer.region(r) + offset + element * elem; };
  sync(header);  // every rank's data is in its region
  // Reduce-scatter: this rank's slice of every region, in rank order, into its own region (others read only
  // their own slices of it, so the write is disjoint from every concurrent read).
  const Slice mine = share(count, size_, rank_, elem);
  std::vector<const void*>& sources = sources_;  // one per rank
  for (int r = 0; r < size_; ++r) sources[r] = at(r, mine.begin);
  reduce_slice(at(rank_, mine.begin), sources, mine.end - mine.begin, dtype, op, divisor);
  sync(header);  // every slice is reduced, in its owner's region
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Slice theirs = share(count, size_, r, elem);
    std::memcpy(at(rank_, theirs.begin), at(r, theirs.begin), (theirs.end - theirs.begin) * elem);
  }
  sync(header);  // every rank has its copies: this rank's slice may be written again
  ++shared_ops_;
}

void ShmGroup::reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root,
                      const CallInfo& call) {
  const OpHeader header = begin(OpKind::Reduce, count, dtype, root, op, call);
  const size_t elem = dtype_size(dtype);
  const size_t chunk = slot_bytes_ / elem;
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk, count - offset);
    reduce_round(header, static_cast<const uint8_t*>(in) + offset * elem,
                 rank_ == root ? static_cast<uint8_t*>(out) + offset * elem : nullptr, n, elem, rank_ == root);
    offset += n;
  } while (offset < count);
}

void ShmGroup::allgather(const void* in, void* out, size_t count, DType dtype, const CallInfo& call) {
  allgather_strided(in, out, count, count, dtype, call);
}

void ShmGroup::allgather_strided(const void* in, void* out, size_t count, size_t out_stride, DType dtype,
                                 const CallInfo& call) {
  const OpHeader header = begin(OpKind::AllGather, count, dtype, -1, ReduceOp::Sum, call);
  const size_t elem = dtype_size(dtype);
  const size_t chunk = slot_bytes_ / elem;
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk, count - offset);
    const uint64_t round = rounds_++;
    const uint8_t* source = static_cast<const uint8_t*>(in) + offset * elem;
    std::memcpy(slot(rank_, round), source, n * elem);
    sync(header);
    for (int r = 0; r < size_; ++r) {
      uint8_t* target = static_cast<uint8_t*>(out) + (r * out_stride + offset) * elem;
      if (target == source) continue;  // in place: this rank's block already holds its contribution
      std::memcpy(target, slot(r, round), n * elem);
    }
    offset += n;
  } while (offset < count);
}

void ShmGroup::gather(const void* in, void* out, size_t count, DType dtype, int root, const CallInfo& call) {
  const OpHeader header = begin(OpKind::Gather, count, dtype, root, ReduceOp::Sum, call);
  const size_t elem = dtype_size(dtype);
  const size_t chunk = slot_bytes_ / elem;
  size_t offset = 0;
  do {
    const size_t n = std::min(chunk, count - offset);
    const uint64_t round = rounds_++;
    std::memcpy(slot(rank_, round), static_cast<const uint8_t*>(in) + offset * elem, n * elem);
    sync(header);
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<uint8_t*>(out) + (r * count + offset) * elem, slot(r, round), n * elem);
      }
    }
    offset += n;
  } while (offset < count);
}

void ShmGroup::scatter(const void* in, void* out, size_t count, DType dtype, int root, const CallInfo& call) {
  const OpHeader header = begin(OpKind::Scatter, count, dtype, root, ReduceOp::Sum, call);
  const size_t elem = dtype_size(dtype);
  const size_t region = slot_bytes_ / size_ / elem;  // elements per destination per round
  size_t offset = 0;
  do {
    const size_t n = std::min(region, count - offset);
    const uint64_t round = rounds_++;
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r) {
        std::memcpy(slot(root, round) + r * region * elem, static_cast<const uint8_t*>(in) + (r * count + offset) * elem,
                    n * elem);
      }
    }
    sync(header);
    std::memcpy(static_cast<uint8_t*>(out) + offset * elem, slot(root, round) + rank_ * region * elem, n * elem);
    offset += n;
  } while (offset < count);
}

void ShmGroup::reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                              const CallInfo& call) {
  const size_t elem = dtype_size(dtype);
  const size_t in_bytes = count * size_ * elem;
  if (in_bytes > kSmallReduceBytes && !shared_.empty()) {
    size_t offset = 0;
    if (std::shared_ptr<SharedBuffer> buffer = find_shared(in, in_bytes, &offset)) {
      reduce_scatter_shared(*buffer, offset, out, count, dtype, op, call);
      return;
    }
  }
  reduce_scatter_strided(in, count, out, count, dtype, op, call);
}

void ShmGroup::reduce_scatter_strided(const void* in, size_t in_stride, void* out, size_t count, DType dtype,
                                      ReduceOp op, const CallInfo& call) {
  const size_t elem = dtype_size(dtype);
  const OpHeader header = begin(OpKind::ReduceScatter, count, dtype, -1, op, call);
  const size_t region = slot_bytes_ / size_ / elem;
  std::vector<const void*>& sources = sources_;  // one per rank
  size_t offset = 0;
  do {
    const size_t n = std::min(region, count - offset);
    const uint64_t round = rounds_++;
    for (int r = 0; r < size_; ++r) {
      std::memcpy(slot(rank_, round) + r * region * elem,
                  static_cast<const uint8_t*>(in) + (r * in_stride + offset) * elem, n * elem);
    }
    sync(header);
    for (int r = 0; r < size_; ++r) sources[r] = slot(r, round) + rank_ * region * elem;
    reduce_slice(static_cast<uint8_t*>(out) + offset * elem, sources, n, dtype, op, 1);
    offset += n;
  } while (offset < count);
}

void ShmGroup::reduce_scatter_shared(SharedBuffer& buffer, size_t offset, void* out, size_t count, DType dtype,
                                     ReduceOp op, const CallInfo& call) {
  const OpHeader header = begin_shared(OpKind::ReduceScatter, buffer, offset, count, dtype, op, call);
  const size_t elem = dtype_size(dtype);
  const uint8_t* input = buffer.region(rank_) + offset;
  const uint8_t* own_block = input + rank_ * count * elem;
  // `out` may be written while the peers read this rank's input if it is private or this rank's own block of
  // it (no peer reads that); any other overlap is reduced aside and copied out once the peers are done.
  const auto* out_begin = static_cast<uint8_t*>(out);
  const bool in_peers_way = out_begin < input + count * size_ * elem && input < out_begin + count * elem &&
                            out_begin != own_block;
  std::vector<uint8_t> aside(in_peers_way ? count * elem : 0);
  sync(header);  // every rank's input is in its region
  // This rank's block of every region, in rank order (the slot path's order, so its bits).
  std::vector<const void*>& sources = sources_;  // one per rank
  for (int r = 0; r < size_; ++r) sources[r] = buffer.region(r) + offset + rank_ * count * elem;
  reduce_slice(in_peers_way ? aside.data() : out, sources, count, dtype, op, 1);
  sync(header);  // every rank has read its block of this rank's region: the caller may write it again
  if (in_peers_way) std::memcpy(out, aside.data(), aside.size());
  ++shared_ops_;
}

void ShmGroup::alltoall(const void* in, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_offsets,
                        void* out, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                        DType dtype, const CallInfo& call) {
  const OpHeader header = begin(OpKind::AllToAll, 0, dtype, -1, ReduceOp::Sum, call);
  const size_t n_ranks = static_cast<size_t>(size_);
  if (send_counts.size() != n_ranks || send_offsets.size() != n_ranks || recv_counts.size() != n_ranks ||
      recv_offsets.size() != n_ranks) {
    throw std::invalid_argument("shardkit " + where(header) + ": split lists must have one entry per rank (" +
                                std::to_string(size_) + ")");
  }
  // Round 0 exchanges the send counts, so every rank knows the whole matrix (and how many data rounds).
  uint64_t round = rounds_++;
  auto* my_counts = reinterpret_cast<uint64_t*>(slot(rank_, round));
  for (int r = 0; r < size_; ++r) my_counts[r] = send_counts[r];
  sync(header);
  std::vector<uint64_t> matrix(n_ranks * n_ranks);  // matrix[i * size + j]: elements rank i sends to j
  for (int r = 0; r < size_; ++r) std::memcpy(&matrix[r * n_ranks], slot(r, round), n_ranks * sizeof(uint64_t));
  const uint64_t largest = *std::max_element(matrix.begin(), matrix.end());
  for (int r = 0; r < size_; ++r) {
    if (matrix[r * n_ranks + rank_] != recv_counts[r]) {
      fail("shardkit " + describe(header) + ": " + rank_name(rank_) + " expects " + std::to_string(recv_counts[r]) +
           " elements from " + rank_name(r) + ", which sends " + std::to_string(matrix[r * n_ranks + rank_]),
           where(header));
    }
  }
  const size_t elem = dtype_size(dtype);
  const size_t region = slot_bytes_ / n_ranks / elem;
  const uint64_t data_rounds = std::max<uint64_t>(1, (largest + region - 1) / region);
  auto part = [&](uint64_t total, uint64_t r) { return std::min<uint64_t>(region, total - std::min(total, r * region)); };
  for (uint64_t r = 0; r < data_rounds; ++r) {
    round = rounds_++;
    for (int dst = 0; dst < size_; ++dst) {
      std::memcpy(slot(rank_, round) + dst * region * elem,
                  static_cast<const uint8_t*>(in) + (send_offsets[dst] + r * region) * elem,
                  part(send_counts[dst], r) * elem);
    }
    sync(header);
    for (int src = 0; src < size_; ++src) {
      std::memcpy(static_cast<uint8_t*>(out) + (recv_offsets[src] + r * region) * elem,
                  slot(src, round) + rank_ * region * elem, part(recv_counts[src], r) * elem);
    }
  }
}

}  // namespace shardkit::core

// ShmGroup: collectives among the ranks of one host through one shared-memory segment.
//
// Segment layout (every offset cache-line or page aligned):
//   GroupHeader                 magic, size, attach counter, abort flag + message, futex word
//   RankControl  x size         per rank: arrival counter, current op header, pid (one cache line pair each)
//   slots        x size x 2     per rank, two data buffers of `slot_bytes` (double buffering, see below)
//
// Protocol. Every collective is a sequence of *rounds*; a round is "each rank writes what it contributes
// into its own slot buffer, then arrives at a sync point, then reads what it needs from any slot". A rank
// arrives by writing its op header and then incrementing its arrival counter (release); it waits until
// every rank's counter reaches the same value. Because each rank only writes its own control block and
// its own slots, there is no read-modify-write contention between ranks.
//
// Double buffering: round t uses buffer t % 2 (t counts rounds over the group's lifetime). A rank can only
// write round t+2's buffer after passing round t+1's sync, which every rank reaches only after finishing
// its reads of round t — so a single sync per round is enough. The large allreduce adds one sync inside
// its round (reduce-scatter step, then all-gather step) and writes only disjoint sub-slices in between.
//
// Agreement: the op header (sequence number, op, dtype, count, root, reduce op, the caller's label and number
// of the collective, and the part of a model it moves: collective_identity.h) travels with each arrival.
// Each waiting rank compares every peer's header with its own; a mismatch aborts the group with a message
// naming both sides, on every rank (the abort flag lives in the segment, and all waits check it).
//
// Waits: spin briefly, then sched_yield, then futex-sleep (ranks may outnumber cores). Every wait has a
// deadline (the group timeout) and checks the pids of the ranks it waits for, so a dead peer is reported
// within about a second, naming the op, its sequence number and the missing ranks. After an abort the
// group refuses further collectives with the same message but can still be destroyed cleanly.
//
// Start-up: the constructor maps the segment (ShmSegment's attach protocol) and syncs once ("start-up sync").
// Both waits watch the peers' pids the caller knows already (Options::pids) and ask Options::abandoned, so a rank
// that dies before it has even mapped the segment, or a start-up that failed on another host, ends them in well
// under a second, naming the rank; whoever gives up removes the segment's name from /dev/shm.
//
// One rank: allreduce, allreduce_average and reduce form the result in one pass from the input to the output,
// skipping the slot and the copy back (a world-1 1 MB allreduce: 24–28 µs instead of 163–166 µs); the other ops
// still go through the slot.
//
// Determinism: every reduction combines ranks in order 0..size-1, and each element is reduced exactly once
// (by one rank, or identically by all ranks), so all ranks get bitwise identical results.
//
// Shared buffers (zero-copy). share_buffer() makes a second segment that holds one region per rank, each
// mapped by every rank. An allreduce whose tensor lies in this rank's region (in == out, past the small-
// message size) skips the slots: sync (every rank's data is in place), each rank reduces its slice of all
// regions into its own region, sync, each rank copies the other slices from their owners' regions, sync
// (nobody reads this rank's region any more, so the caller may write it again). Same slices' reduction in
// the same rank order as the slot path, so the bits are the same; one copy of the data in and one out fewer.
// A reduce-scatter whose input lies in this rank's region (past the small-message size) skips the slots the
// same way: sync (every rank's input is in place), each rank reduces its block of every region into its
// output, sync (nobody reads this rank's region any more). Same blocks, same rank order: the slot path's bits.
// The op header says the op is in a shared buffer, which and where, so ranks that disagree on it fail at once.
// An AVG (allreduce_average) divides each slice once, right after reducing it, on either path.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <type_traits>
#include <vector>

#include "core/liveness.h"
#include "core/types.h"

namespace shardkit::core {

class ShmSegment;
struct GroupHeader;
struct RankControl;

// Memory every rank of a group maps: one region of bytes() per rank (ShmGroup::share_buffer). A tensor in this
// rank's region is reduced by ShmGroup::allreduce / reduce_scatter straight from the peers' regions (see
// "Shared buffers").
// The memory lives while any rank maps it: this object (or, in the peers, their own) keeps the mapping,
// and the segment's name is gone from /dev/shm as soon as every rank has mapped it.
class SharedBuffer {
 public:
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  size_t bytes() const { return bytes_; }
  uint8_t* mine() const { return region(rank_); }
  uint8_t* region(int rank) const;

 private:
  friend class ShmGroup;
  SharedBuffer(std::unique_ptr<ShmSegment> segment, size_t bytes, size_t stride, int rank, uint32_t id);

  std::unique_ptr<ShmSegment> segment_;
  uint32_t id_;  // the group's count of buffers made when this one was: the same on every rank
  size_t bytes_;
  size_t stride_;  // between regions (page aligned)
  int rank_;
};

// What a collective is, as every rank must agree on it. Travels in shared memory.
enum class OpKind : uint32_t {
  Barrier = 1,
  Broadcast,
  AllReduce,
  Reduce,
  AllGather,
  Gather,
  Scatter,
  ReduceScatter,
  AllToAll,
  ShareBuffer,
};
const char* op_kind_name(OpKind kind);

constexpr size_t kOpLabelBytes = 24;

struct OpHeader {
  uint64_t seq = 0;    // collective number in this group, from 1
  uint64_t count = 0;  // elements per rank, as the op defines it (0 for alltoall: splits are checked apart)
  OpKind kind = OpKind::Barrier;
  int32_t root = -1;
  DType dtype = DType::U8;
  ReduceOp reduce_op = ReduceOp::Sum;
  uint8_t is_step = 0;  // one step of a larger collective (label names that collective)
  uint8_t shared = 0;   // the op's input is in shared buffer shared_id, at shared_offset in every rank's region
  uint32_t shared_id = 0;
  uint64_t shared_offset = 0;
  uint32_t divide_by = 1;  // an allreduce whose every result element is divided by this (AVG)
  uint32_t pad2 = 0;
  uint64_t label_seq = 0;             // the caller's collective number (CallInfo::seq)
  uint64_t identity = 0;              // the part of a model the caller's collective moves (CallInfo::identity)
  char label[kOpLabelBytes] = {};     // the caller's collective name (CallInfo::op), NUL-padded
};
// Headers are compared with memcmp across processes: no byte of one may be padding (indeterminate).
static_assert(std::has_unique_object_representations_v<OpHeader>, "OpHeader must have no implicit padding");

// What the caller of one collective tells the group about it; travels with the op (nothing of it is kept
// between ops). Messages then name the collective the user issued, with the user's numbering, even where
// this group only runs one step of it (a hierarchical collective across hosts).
struct CallInfo {
  std::chrono::milliseconds timeout{0};  // this op's deadline; 0: the group's default
  const char* op = nullptr;              // the user's collective; null: this op's own name
  uint64_t seq = 0;                      // the user's collective number; 0 with op null: this group's count
  bool is_step = false;                  // this op is one step of `op` (messages say which step)
  uint64_t identity = 0;                 // core::current_identity() where `op` was issued (collective_identity.h)
};

class ShmGroup {
 public:
  struct Options {
    std::string name;  // shm name, starts with '/', unique per job and group (the adapter agrees it)
    int rank = 0;
    int size = 1;
    size_t slot_bytes = size_t{1} << 20;  // per rank and buffer; collectives of any size are chunked
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // default deadline of every wait
    // How messages name the ranks: rank_names[r] for this group's rank r (its global rank in the job). Empty: the
    // group's own numbering.
    std::vector<int> rank_names;
    // pids[r]: the process of this group's rank r, where the caller knows it before the segment exists (the
    // backend exchanges them at start-up): a rank that dies before it has mapped the segment and written its pid
    // there is then still seen to be gone. 0 (or empty): the pid rank r writes into its control block;
    // kUnwatchedPid: never watched (another pid namespace).
    std::vector<int32_t> pids;
    // Asked while the constructor waits (segment attach, first sync): a non-empty answer ends the start-up with a
    // std::runtime_error carrying it (the start-up failed on another rank, maybe on another host).
    std::function<std::string()> abandoned;
    // Busy processes expected on this machine (e.g. torchrun's LOCAL_WORLD_SIZE, which also counts ranks of
    // other groups, or of simulated hosts); waits spin less when they outnumber the cores. 0: the group size.
    int processes_on_machine = 0;
  };

  explicit ShmGroup(const Options& options);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  uint64_t seq() const { return seq_; }
  // The default deadline of ops whose CallInfo sets none.
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  // Collective: a buffer of `bytes` per rank that every rank maps (see "Shared buffers" above). Every rank
  // passes the same size. Null on every rank, with the reason in `*refused` (if given), where /dev/shm has not
  // the room (rank 0 asks, all ranks hear its answer): callers then use ordinary memory. Throws as the ops below
  // do; a failure to make or map the segment aborts the group (every rank raises it, none waits it out).
  std::shared_ptr<SharedBuffer> share_buffer(size_t bytes, const CallInfo& call = {}, std::string* refused = nullptr);
  // Collectives (allreduce, reduce_scatter) that read their input from a shared buffer, without the slots
  // (for tests and benchmarks).
  uint64_t shared_ops() const { return shared_ops_.load(std::memory_order_relaxed); }

  // One op at a time: the ops below are called from one thread at a time (the backend's work queue
  // serializes them), and share per-group scratch.
  // All pointers are to contiguous host memory; counts are in elements. `in` and `out` may be the same
  // buffer where the op's shapes allow it (allreduce, broadcast). All throw std::runtime_error on
  // disagreement, timeout, dead peer or a previous abort. Roots are ranks of this group.
  void barrier(const CallInfo& call = {});
  void broadcast(void* data, size_t count, DType dtype, int root, const CallInfo& call = {});
  void allreduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, const CallInfo& call = {});
  // allreduce, then every result element divided by `divisor` (integers toward zero; divide_in_place's
  // bits), the division done once per element inside the reduction — before a slice is shared — instead of
  // in a pass of its own afterwards. Same bits as allreduce followed by divide_in_place.
  void allreduce_average(const void* in, void* out, size_t count, DType dtype, int64_t divisor,
                         const CallInfo& call = {});
  // Only `root`'s out is written; other ranks may pass nullptr.
  void reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root,
              const CallInfo& call = {});
  // out holds size * count elements, rank r's contribution at offset r * count. `in` may be this rank's own
  // block of `out` (in == out + rank * count elements: ZeRO's in-place all-gather); that block is then left
  // as it is instead of being copied back onto itself. Any other overlap of in and out is not allowed.
  void allgather(const void* in, void* out, size_t count, DType dtype, const CallInfo& call = {});
  // allgather with rank r's block at out + r * out_stride elements (out_stride >= count): one piece of each block of a
  // larger all-gather (the hierarchical engine's pipeline). The same op to the peers, whatever their strides.
  void allgather_strided(const void* in, void* out, size_t count, size_t out_stride, DType dtype,
                         const CallInfo& call = {});
  // Like allgather, but only root's out is written.
  void gather(const void* in, void* out, size_t count, DType dtype, int root, const CallInfo& call = {});
  // root's in holds size * count elements; every rank receives its count-element block.
  void scatter(const void* in, void* out, size_t count, DType dtype, int root, const CallInfo& call = {});
  // in holds size * count elements; rank r gets the reduction of every rank's block r. `out` may be this
  // rank's own block of `in`; no other overlap is allowed.
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op, const CallInfo& call = {});
  // reduce_scatter with rank r's block of `in` at in + r * in_stride elements (in_stride >= count; never read from a
  // shared buffer): one piece of each block of a larger reduce-scatter, as allgather_strided.
  void reduce_scatter_strided(const void* in, size_t in_stride, void* out, size_t count, DType dtype, ReduceOp op,
                              const CallInfo& call = {});
  // send_counts[j] elements go from this rank to rank j, read from in at send_offsets[j]; received
  // blocks land in out at recv_offsets[j]. Every pair's send and receive counts must agree.
  void alltoall(const void* in, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_offsets,
                void* out, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_offsets,
                DType dtype, const CallInfo& call = {});

  // The ranks (rank_names, pid) this rank saw exit while it waited for them, in the op that failed, handed over
  // once (what the backend records as deaths for the job): empty afterwards, and when the failure was not a
  // death or another rank saw it first.
  std::vector<std::pair<int, int32_t>> take_exited_peers() { return std::exchange(exited_, {}); }

  // True once the group is aborted (disagreement, timeout, dead peer, or abort()); the message says why.
  bool aborted() const;
  std::string abort_message() const;
  // Aborts the group on every local rank from outside an op (e.g. a step of a larger collective failed
  // elsewhere): ranks waiting now, and every later op, fail with `message`. Returns false, changing
  // nothing, if the group was already aborted (the first reason stands).
  bool abort(const std::string& message);

 private:
  // Starts a collective: bumps the sequence number, fails fast if the group is already aborted, and
  // takes the op's deadline from `call`.
  OpHeader begin(OpKind kind, size_t count, DType dtype, int root, ReduceOp op, const CallInfo& call);
  // Arrive at the next sync point with `header` and wait for every rank.
  void sync(const OpHeader& header);
  uint8_t* slot(int rank, uint64_t round) const;
  // Aborts from inside an op and throws: `message` if this rank aborted first, else the first reason,
  // behind `where` (the op and this rank, as where(header) says them; this rank alone if empty).
  [[noreturn]] void fail(const std::string& message, const std::string& where = "");
  // How messages number this group's rank r (rank_names[r]; r itself without names or out of range), and
  // name it ("rank 3").
  int rank_number(int r) const { return peers_.name(r); }
  // The pid of rank r: as the caller gave it, else as r wrote it into its control block (0: not yet; kUnwatchedPid
  // as given).
  int32_t pid_of(int r) const;
  std::string rank_name(int r) const;
  std::string where(const OpHeader& header) const;  // "allreduce #3 (f32 x 16, sum) (rank 0)"
  void check_peer_header(int peer, const OpHeader& mine, uint64_t target);
  std::string describe(const OpHeader& header) const;
  // The shared buffer holding [data, data + bytes) in this rank's region, and the offset there; null if none.
  std::shared_ptr<SharedBuffer> find_shared(const void* data, size_t bytes, size_t* offset);
  // The zero-copy allreduce of `count` elements at `offset` in every rank's region of `buffer`.
  void allreduce_shared(SharedBuffer& buffer, size_t offset, size_t count, DType dtype, ReduceOp op,
                        int64_t divisor, const CallInfo& call);
  // The zero-copy reduce-scatter: every rank's input at `offset` in its region of `buffer`.
  void reduce_scatter_shared(SharedBuffer& buffer, size_t offset, void* out, size_t count, DType dtype, ReduceOp op,
                             const CallInfo& call);
  // An op's header, marked as reading its input at `offset` in every rank's region of `buffer`.
  OpHeader begin_shared(OpKind kind, SharedBuffer& buffer, size_t offset, size_t count, DType dtype, ReduceOp op,
                        const CallInfo& call);
  void allreduce_impl(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int64_t divisor,
                      const CallInfo& call);
  // The large-message allreduce/reduce round: reduce-scatter through the slots, then gather the result.
  // `divisor` > 1: the result divided by it (allreduce_average).
  void reduce_round(const OpHeader& header, const uint8_t* in, uint8_t* out, size_t count, size_t elem,
                    bool copy_out, int64_t divisor = 1);

  int rank_;
  int size_;
  size_t slot_bytes_;
  std::chrono::milliseconds timeout_;     // default deadline
  std::chrono::milliseconds op_timeout_;  // the running op's deadline (from its CallInfo)
  PeerNames peers_;  // names and (caller-given) pids of the group's ranks
  std::function<std::string()> starting_;  // Options::abandoned, while the constructor runs; empty afterwards
  std::vector<std::pair<int, int32_t>> exited_;
  bool oversubscribed_;  // more busy processes than usable cores: waits spin less (see WaitPolicy)
  std::unique_ptr<ShmSegment> segment_;
  GroupHeader* header_ = nullptr;
  RankControl* controls_ = nullptr;
  uint8_t* slots_ = nullptr;
  uint64_t seq_ = 0;      // collectives started
  uint64_t arrivals_ = 0;  // sync points passed (this rank's arrival counter)
  uint64_t rounds_ = 0;   // data rounds started (selects the buffer)
  // Scratch reused by every op, so that a small collective allocates nothing: the peers sync() still waits
  // for, and the per-rank pointers a reduction reads (size() entries, set by the constructor).
  std::vector<int> pending_;
  std::vector<const void*> sources_;
  // The shared buffers made on this group that may still be alive (their users own them).
  std::vector<std::weak_ptr<SharedBuffer>> shared_;
  uint32_t shared_made_ = 0;
  std::atomic<uint64_t> shared_ops_{0};  // read from other threads (shared_ops())
};

}  // namespace shardkit::core

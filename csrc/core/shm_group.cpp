// ShmGroup: segment layout, the sync point (arrive + wait), agreement checks and abort.
// The collective algorithms themselves live in shm_collectives.cpp.
#include "core/shm_group.h"

#include <sched.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "core/collective_identity.h"
#include "core/futex.h"
#include "core/liveness.h"
#include "core/shm_segment.h"

namespace shardkit::core {

namespace {

constexpr uint64_t kMagic = 0x736861726b6b6974ULL;  // "sharkkit"
constexpr size_t kPage = 4096;
constexpr size_t kAbortMessageBytes = 1024;

// How a wait escalates: spin (cheapest wake-up), then sched_yield, then sleep on the futex. When the
// machine's busy processes (this group's ranks, or Options::processes_on_machine if more) outnumber the
// cores this process may run on (4 ranks on 2 cores in CI), every spinning waiter steals the core from a
// rank that has not arrived yet, so the spin and yield phases shrink.
struct WaitPolicy {
  int spin_iterations;
  std::chrono::microseconds yield_for;
};
constexpr WaitPolicy kDedicatedCores{256, std::chrono::microseconds(200)};
constexpr WaitPolicy kOversubscribed{16, std::chrono::microseconds(20)};
constexpr auto kFutexSleep = std::chrono::microseconds(2000);

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}
constexpr auto kLivenessEvery = std::chrono::milliseconds(200);

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

struct alignas(64) GroupHeader {
  uint64_t magic;
  uint64_t slot_bytes;
  uint32_t size;
  alignas(64) std::atomic<uint32_t> attached;
  alignas(64) std::atomic<uint32_t> futex_word;  // bumped on every arrival that may have sleepers
  std::atomic<uint32_t> sleepers;                // ranks currently (about to be) asleep on futex_word
  alignas(64) std::atomic<uint32_t> abort_state;  // 0 ok, 1 message being written, 2 aborted
  char abort_message[kAbortMessageBytes];
};

// One per rank, written only by that rank. Two cache lines so neighbours never share one.
struct alignas(128) RankControl {
  std::atomic<uint64_t> arrivals;        // sync points this rank has reached
  std::atomic<uint64_t> header_version;  // seqlock over `header`: 2 * arrival when stable, odd while written
  OpHeader header;                       // the op it reached its latest arrival for
  int32_t pid;
};

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::Barrier: return "barrier";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllReduce: return "allreduce";
    case OpKind::Reduce: return "reduce";
    case OpKind::AllGather: return "allgather";
    case OpKind::Gather: return "gather";
    case OpKind::Scatter: return "scatter";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::AllToAll: return "alltoall";
    case OpKind::ShareBuffer: return "share_buffer";
  }
  return "unknown";
}

ShmGroup::ShmGroup(const Options& options)
    : rank_(options.rank),
      size_(options.size),
      slot_bytes_(round_up(options.slot_bytes, kPage)),
      timeout_(options.timeout),
      op_timeout_(options.timeout),
      peers_{options.rank_names, options.pids},
      starting_(options.abandoned),
      oversubscribed_(std::max(options.size, options.processes_on_machine) > usable_cores()) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
    throw std::invalid_argument("shardkit shm: invalid rank " + std::to_string(rank_) + " for group size " +
                                std::to_string(size_));
  }
  pending_.reserve(size_);
  sources_.resize(size_);
  if (slot_bytes_ < kPage) throw std::invalid_argument("shardkit shm: slot_bytes must be positive");
  if (!peers_.names.empty() && static_cast<int>(peers_.names.size()) != size_) {
    throw std::invalid_argument("shardkit shm: rank_names has " + std::to_string(peers_.names.size()) +
                                " entries for a group of size " + std::to_string(size_));
  }
  if (!peers_.pids.empty() && static_cast<int>(peers_.pids.size()) != size_) {
    throw std::invalid_argument("shardkit shm: pids has " + std::to_string(peers_.pids.size()) +
                                " entries for a group of size " + std::to_string(size_));
  }
  const size_t header_bytes = round_up(sizeof(GroupHeader), kPage);
  const size_t control_bytes = round_up(sizeof(RankControl) * size_, kPage);
  const size_t total = header_bytes + control_bytes + slot_bytes_ * 2 * size_;
  segment_ = std::make_unique<ShmSegment>(options.name, total, rank_, size_, offsetof(GroupHeader, attached),
                                          timeout_, AttachWatch{peers_, starting_});
  uint8_t* base = segment_->data();
  header_ = reinterpret_cast<GroupHeader*>(base);
  controls_ = reinterpret_cast<RankControl*>(base + header_bytes);
  slots_ = base + header_bytes + control_bytes;
  if (rank_ == 0) {
    header_->magic = kMagic;
    header_->slot_bytes = slot_bytes_;
    header_->size = static_cast<uint32_t>(size_);
  }
  controls_[rank_].pid = static_cast<int32_t>(getpid());
  // The first sync publishes rank 0's header fields and every pid; then check that all ranks laid the
  // segment out alike (a mismatch means ranks were started with different slot sizes).
  try {
    barrier(CallInfo{timeout_, "start-up sync", 1, false});
  } catch (...) {
    segment_->unlink_name();  // the creator may have died before every rank attached: it never will
    throw;
  }
  starting_ = nullptr;
  if (header_->magic != kMagic || header_->size != static_cast<uint32_t>(size_) ||
      header_->slot_bytes != slot_bytes_) {
    throw std::runtime_error("shardkit shm (" + rank_name(rank_) + "): segment '" + options.name +
                             "' was laid out by rank 0 for size " + std::to_string(header_->size) +
                             " and slot_bytes " + std::to_string(header_->slot_bytes) + ", this rank expects " +
                             std::to_string(size_) + " and " + std::to_string(slot_bytes_));
  }
}

ShmGroup::~ShmGroup() = default;

SharedBuffer::SharedBuffer(std::unique_ptr<ShmSegment> segment, size_t bytes, size_t stride, int rank, uint32_t id)
    : segment_(std::move(segment)), id_(id), bytes_(bytes), stride_(stride), rank_(rank) {}

SharedBuffer::~SharedBuffer() = default;

// Layout of a shared buffer's segment: one page for the attach counter, then the regions, page aligned.
uint8_t* SharedBuffer::region(int rank) const { return segment_->data() + kPage + static_cast<size_t>(rank) * stride_; }

std::shared_ptr<SharedBuffer> ShmGroup::share_buffer(size_t bytes, const CallInfo& call, std::string* refused) {
  // The sync checks that every rank asks for the same size, in the same place among the group's ops.
  const OpHeader header = begin(OpKind::ShareBuffer, bytes, DType::U8, -1, ReduceOp::Sum, call);
  sync(header);
  const size_t stride = round_up(std::max<size_t>(bytes, 1), kPage);
  const size_t total = kPage + stride * size_;
  // Room in /dev/shm, as rank 0 sees it, for every rank to hear (a broadcast): all make the buffer or none.
  int64_t free_bytes = 0;
  if (rank_ == 0) {
    struct statvfs fs{};
    const bool known = statvfs("/dev/shm", &fs) == 0;
    const long double room = known ? static_cast<long double>(fs.f_bavail) * fs.f_frsize : 0.0L;
    free_bytes = !known || room >= static_cast<long double>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(room);
  }
  broadcast(&free_bytes, 1, DType::I64, 0, call);
  if (free_bytes < static_cast<int64_t>(total)) {
    if (refused != nullptr) {
      *refused = "/dev/shm has " + std::to_string(free_bytes) + " bytes free and the buffer needs " +
                 std::to_string(total);
    }
    return nullptr;
  }
  // The segment's own attach protocol makes, reserves, maps and unlinks it (names differ by the count of
  // buffers). A rank that fails aborts the group, and the others stop waiting for it at once.
  const uint32_t id = ++shared_made_;
  std::unique_ptr<ShmSegment> segment;
  try {
    PeerNames peers{peers_.names, {}};
    for (int r = 0; r < size_; ++r) peers.pids.push_back(pid_of(r));  // all written by now (the first sync)
    segment = std::make_unique<ShmSegment>(segment_->name() + ".buf" + std::to_string(id), total, rank_, size_, 0,
                                           op_timeout_, AttachWatch{std::move(peers), [this] {
                                             return aborted() ? abort_message() : std::string();
                                           }});
  } catch (const std::exception& error) {
    fail(std::string(error.what()), where(header));
  }
  std::shared_ptr<SharedBuffer> buffer(new SharedBuffer(std::move(segment), bytes, stride, rank_, id));
  shared_.erase(std::remove_if(shared_.begin(), shared_.end(), [](const auto& weak) { return weak.expired(); }),
                shared_.end());
  shared_.push_back(buffer);
  return buffer;
}

std::shared_ptr<SharedBuffer> ShmGroup::find_shared(const void* data, size_t bytes, size_t* offset) {
  const auto* begin = static_cast<const uint8_t*>(data);
  for (const auto& weak : shared_) {
    std::shared_ptr<SharedBuffer> buffer = weak.lock();
    if (!buffer) continue;
    const uint8_t* mine = buffer->mine();
    if (begin >= mine && begin + bytes <= mine + buffer->bytes()) {
      *offset = static_cast<size_t>(begin - mine);
      return buffer;
    }
  }
  return nullptr;
}

bool ShmGroup::aborted() const { return header_->abort_state.load(std::memory_order_acquire) != 0; }

std::string ShmGroup::abort_message() const {
  while (header_->abort_state.load(std::memory_order_acquire) == 1) sched_yield();
  if (header_->abort_state.load(std::memory_order_acquire) == 0) return {};
  return std::string(header_->abort_message, strnlen(header_->abort_message, kAbortMessageBytes));
}

bool ShmGroup::abort(const std::string& message) {
  uint32_t expected = 0;
  if (!header_->abort_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return false;
  std::strncpy(header_->abort_message, message.c_str(), kAbortMessageBytes - 1);
  header_->abort_message[kAbortMessageBytes - 1] = '\0';
  header_->abort_state.store(2, std::memory_order_release);
  header_->futex_word.fetch_add(1);
  futex_wake_all(&header_->futex_word);
  return true;
}

void ShmGroup::fail(const std::string& message, const std::string& where) {
  if (abort(message)) throw std::runtime_error(message);
  // Someone aborted first: theirs is the root cause, told behind this rank's own op.
  const std::string mine = where.empty() ? "(" + rank_name(rank_) + ")" : where;
  throw std::runtime_error("shardkit " + mine + ": group aborted: " + abort_message());
}

int32_t ShmGroup::pid_of(int r) const {
  const int32_t given = peers_.pid(r);
  return given != 0 ? given : controls_[r].pid;
}

std::string ShmGroup::rank_name(int r) const { return "rank " + std::to_string(rank_number(r)); }

std::string ShmGroup::where(const OpHeader& header) const {
  return describe(header) + " (" + rank_name(rank_) + ")";
}

OpHeader ShmGroup::begin(OpKind kind, size_t count, DType dtype, int root, ReduceOp op, const CallInfo& call) {
  OpHeader header;
  header.seq = ++seq_;
  header.kind = kind;
  header.count = count;
  header.dtype = dtype;
  header.root = root;
  header.reduce_op = op;
  header.is_step = call.is_step ? 1 : 0;
  header.label_seq = call.op != nullptr ? call.seq : header.seq;
  header.identity = call.identity;
  std::strncpy(header.label, call.op != nullptr ? call.op : op_kind_name(kind), kOpLabelBytes - 1);
  op_timeout_ = call.timeout.count() > 0 ? call.timeout : timeout_;
  if (aborted()) {
    throw std::runtime_error("shardkit " + where(header) + ": group was aborted earlier: " + abort_message());
  }
  if (root != -1 && (root < 0 || root >= size_)) {
    throw std::invalid_argument("shardkit " + where(header) + ": root " + std::to_string(root) +
                                " is outside group of size " + std::to_string(size_));
  }
  return header;
}

std::string ShmGroup::describe(const OpHeader& h) const {
  std::ostringstream out;
  out << std::string(h.label, strnlen(h.label, kOpLabelBytes)) << " #" << h.label_seq;
  if (h.kind == OpKind::Barrier && !h.is_step) return out.str();
  out << " (";
  if (h.is_step) out << "step: " << op_kind_name(h.kind) << " within the host" << (h.kind == OpKind::Barrier ? "" : ", ");
  if (h.kind != OpKind::Barrier) {
    out << dtype_name(h.dtype);
    if (h.kind != OpKind::AllToAll) out << " x " << h.count;
    if (h.kind == OpKind::AllReduce || h.kind == OpKind::Reduce || h.kind == OpKind::ReduceScatter) {
      out << ", " << reduce_op_name(h.reduce_op);
    }
    if (h.root >= 0) out << ", root " << rank_number(h.root);
    if (h.divide_by > 1) out << ", divided by " << h.divide_by;
    if (h.shared) out << ", in shared buffer " << h.shared_id << " at byte " << h.shared_offset;
  }
  out << ")";
  if (h.identity != 0) out << " for " << describe_identity(h.identity);
  return out.str();
}

uint8_t* ShmGroup::slot(int rank, uint64_t round) const {
  return slots_ + (static_cast<size_t>(rank) * 2 + (round & 1)) * slot_bytes_;
}

void ShmGroup::check_peer_header(int peer, const OpHeader& mine, uint64_t target) {
  // Seqlock read. The peer may already have passed this sync point and be writing its next header; then
  // the version differs from 2 * target and the peer, having seen our arrival, did the comparison itself.
  RankControl& control = controls_[peer];
  const uint64_t before = control.header_version.load(std::memory_order_acquire);
  if (before != 2 * target) return;
  OpHeader theirs;
  std::memcpy(&theirs, &control.header, sizeof(OpHeader));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (control.header_version.load(std::memory_order_relaxed) != before) return;
  if (std::memcmp(&theirs, &mine, sizeof(OpHeader)) == 0) return;
  fail("shardkit: ranks disagree on collective #" + std::to_string(mine.label_seq) + ": " + rank_name(rank_) +
       " called " + describe(mine) + " but " + rank_name(peer) + " called " + describe(theirs));
}

void ShmGroup::sync(const OpHeader& header) {
  using clock = std::chrono::steady_clock;
  const uint64_t target = ++arrivals_;
  RankControl& me = controls_[rank_];
  me.header_version.store(2 * target - 1, std::memory_order_relaxed);  // odd: header being rewritten
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(&me.header, &header, sizeof(OpHeader));
  me.header_version.store(2 * target, std::memory_order_release);
  me.arrivals.store(target, std::memory_order_seq_cst);
  // Pairs with the sleeper's seq_cst increment + re-check below: either it sees our arrival, or we see it.
  if (header_->sleepers.load(std::memory_order_seq_cst) != 0) {
    header_->futex_word.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&header_->futex_word);
  }
  if (size_ == 1) return;

  std::vector<int>& pending = pending_;
  pending.clear();
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) pending.push_back(peer);
  }
  auto drop_arrived = [&] {
    size_t kept = 0;
    for (int peer : pending) {
      uint64_t seen = controls_[peer].arrivals.load(std::memory_order_acquire);
      if (seen >= target) {
        if (seen == target) check_peer_header(peer, header, target);
      } else {
        pending[kept++] = peer;
      }
    }
    pending.resize(kept);
    return pending.empty();
  };

  const auto start = clock::now();
  const auto deadline = start + op_timeout_;
  auto next_liveness = start + kLivenessEvery;
  for (int iteration = 0;; ++iteration) {
    if (drop_arrived()) return;
    if (aborted()) {
      throw std::runtime_error("shardkit " + where(header) + ": group aborted: " + abort_message());
    }
    const WaitPolicy& policy = oversubscribed_ ? kOversubscribed : kDedicatedCores;
    if (iteration < policy.spin_iterations) {
      cpu_relax();
      continue;
    }
    const auto now = clock::now();
    if (now - start < policy.yield_for) {
      sched_yield();
      continue;
    }
    if (now >= next_liveness) {
      next_liveness = now + kLivenessEvery;
      if (auto dead = peers_.exited(pending, [this](int r) { return pid_of(r); }); !dead.empty()) {
        exited_ = std::move(dead);
        fail("shardkit " + where(header) + ": rank(s) " + describe_exited(exited_) + " exited before arriving",
             where(header));
      }
      if (starting_) {  // the first sync of the constructor: the start-up may have failed on another host
        if (const std::string why = starting_(); !why.empty()) fail(why, where(header));
      }
    }
    if (now >= deadline) {
      std::string missing;
      for (int peer : pending) missing += (missing.empty() ? "" : ", ") + std::to_string(rank_number(peer));
      fail("shardkit " + where(header) + ": Timed out after " + std::to_string(op_timeout_.count()) +
           " ms waiting for rank(s) [" + missing + "]", where(header));
    }
    struct SleeperMark {  // counted as a sleeper until this scope ends, even if a check throws
      std::atomic<uint32_t>& sleepers;
      explicit SleeperMark(std::atomic<uint32_t>& s) : sleepers(s) { sleepers.fetch_add(1, std::memory_order_seq_cst); }
      ~SleeperMark() { sleepers.fetch_sub(1, std::memory_order_seq_cst); }
    } mark(header_->sleepers);
    const uint32_t word = header_->futex_word.load(std::memory_order_seq_cst);
    if (!drop_arrived() && !aborted()) futex_wait(&header_->futex_word, word, kFutexSleep);
  }
}

}  // namespace shardkit::core

// The flight recorder: every shardkit group keeps a ring of its last N collectives on this rank, and the process
// writes all its groups' rings to one file per rank when something goes wrong, so a hung or failed job leaves a
// picture of which rank was where (docs/reliability.md, "A job that hangs: the flight recorder").
//
// What it promises:
//   - Recording costs no allocation and no contention on the collective's path: a ring of TraceEntry slots
//     preallocated at the group's creation (SHARDKIT_TRACE_BUFFER entries, default 2000; 0 turns recording off),
//     written under one short, per-group critical section (a slot copy) when an op is issued, starts and ends.
//     Tensor shapes are kept inline (the first kTracedTensors tensors of each side, kTracedDims dims each; a tensor
//     of more dims is kept as its element count, the count of tensors always whole).
//   - An entry says: the op (shardkit's name and torch's), the issue and run numbers (OpContext::seq: what error
//     messages name), the identity of the part it moved (core/collective_identity.h: an FSDP unit, a DDP bucket),
//     input and output shapes and dtypes, the wall-clock times it was issued, started and ended (ns since the
//     epoch, torch's time_*_ns), and its state: scheduled, started, completed or failed.
//   - Dumps, one file per rank, `<dir>/shardkit_trace_rank_<global rank>` (dir: SHARDKIT_TRACE_DIR, default
//     `<temp dir>/shardkit_traces/<job>`, trace_dir()), written whole or not at all (a temporary file, then a
//     rename), holding every live group of the process: on the first failure of a group's op (timeout, abort, a
//     peer's death: the backend's failure path, which appends the file's path to the error), on
//     shardkit.dump_traces(), and on SIGUSR1 where the process had no handler for it (install_signal_handler();
//     the handler only posts a semaphore: the dump is written by the recorder's own thread, which the process's
//     TraceRegistry owns and joins at exit).
//   - The file is a pickle (protocol 2) of plain dicts, lists, tuples, strings, numbers, booleans and None, no
//     other object, in the layout of torch's flight recorder (FlightRecorder.hpp, version "2.10": version, pg_config,
//     pg_status, entries with torch's field names) plus a few shardkit fields (`shardkit_*`); shardkit reads it with
//     an unpickler that admits no global at all (python/shardkit/_trace.py).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardkit::comm {

enum class TraceState : uint8_t { kEmpty = 0, kScheduled, kStarted, kCompleted, kFailed };

constexpr int kTracedTensors = 4;  // tensors whose shapes an entry keeps, per side
constexpr int kTracedDims = 5;     // dims kept per tensor (a tensor of more: kept as [numel])

// The tensors on one side of an op, inline.
struct TracedTensors {
  int32_t count = 0;  // all the op's tensors on this side (those past kTracedTensors are counted only)
  std::array<int8_t, kTracedTensors> ndim{};
  std::array<int8_t, kTracedTensors> dtype{};  // c10::ScalarType
  std::array<int64_t, kTracedTensors * kTracedDims> dims{};

  void set(const std::vector<at::Tensor>& tensors);
};

struct TraceEntry {
  uint64_t ticket = 0;     // this ring's count of recorded ops (1, 2, ...); 0: the slot was never written
  uint64_t record_id = 0;  // the process's count of recorded ops, over all groups (torch's record_id)
  uint64_t issued = 0;     // the group's issue number (ProcessGroupShardkit::getSequenceNumberForGroup)
  uint64_t seq = 0;        // OpContext::seq once the op started (what messages name), 0 before
  const char* op = "";     // shardkit's name of the op (a string literal: OpContext::op)
  uint64_t identity = 0;   // core::current_identity() when the op was issued
  int64_t timeout_ms = 0;
  int64_t created_ns = 0, started_ns = 0, ended_ns = 0;  // system clock, ns since the epoch; 0: not yet
  TraceState state = TraceState::kEmpty;
  TracedTensors inputs, outputs;
};

// One group's ring. Thread-safe: the issuing thread records, the worker marks start and end, a dump reads.
class TraceRing {
 public:
  struct Group {
    std::string name;         // torch's group name (Backend::getGroupUid), or a number where torch set none
    std::string description;  // torch's group description (Backend::getGroupDesc)
    std::vector<int> ranks;   // the group's ranks as the job numbers them
    int rank = 0;             // this rank in the group
    int global_rank = 0;      // this rank in the job
  };

  // `capacity` 0: records nothing (every call returns at once). `describe` is called at dump time.
  TraceRing(size_t capacity, std::function<Group()> describe);

  size_t capacity() const { return slots_.size(); }
  // Records an op as issued (scheduled); returns its ticket for started()/ended(), 0 when recording is off.
  uint64_t issued(const char* op, uint64_t issued, uint64_t identity, std::chrono::milliseconds timeout,
                  const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
  void started(uint64_t ticket, uint64_t seq);
  void ended(uint64_t ticket, bool ok);

  // The ring's entries, oldest first, and what describe() says of the group.
  std::vector<TraceEntry> entries() const;
  Group describe() const { return describe_(); }
  // The path of the dump written for this group's first failure, set once (empty before).
  std::string failure_dump();
  // True the first time only: the caller writes the failure's dump.
  bool claim_failure_dump(const std::string& path);

 private:
  TraceEntry* slot(uint64_t ticket);  // under mutex_; null where the slot was reused since

  mutable std::mutex mutex_;
  std::vector<TraceEntry> slots_;
  uint64_t next_ = 0;  // tickets handed out
  std::function<Group()> describe_;
  std::mutex failure_mutex_;
  bool failure_dumped_ = false;
  std::string failure_path_;
};

// What recording costs, measured alone: `iterations` ops of one 1024-element tensor recorded (issued, started,
// ended) on a private ring of `capacity` entries, on this thread; nanoseconds per op. For benchmarks/trace.py.
double trace_cost_ns(int64_t iterations, size_t capacity);

// SHARDKIT_TRACE_BUFFER (entries per group; default 2000; 0: off). Raises on a value that is not a count.
size_t trace_capacity();
// SHARDKIT_TRACE_DIR, or `<temp dir>/shardkit_traces/<job>` (job: TORCHELASTIC_RUN_ID, else MASTER_PORT's value).
std::string trace_dir();

// The process's live rings (every group registers its own) and the SIGUSR1 dumper thread.
class TraceRegistry {
 public:
  static void add(const std::shared_ptr<TraceRing>& ring);
  static void remove(const TraceRing* ring);
  // Writes every live ring of the process into `<trace_dir()>/shardkit_trace_rank_<global rank>` and returns the
  // path; `reason` is kept in the file. Raises where the file cannot be written. Thread-safe.
  static std::string dump(const std::string& reason);
  // The same, into `path`.
  static void dump_to(const std::string& path, const std::string& reason);
  // Installs the SIGUSR1 handler where the process has none (its disposition is the default) and starts the thread
  // that writes the dump it asks for; idempotent. Returns whether shardkit's handler is the one installed.
  static bool install_signal_handler();
};

}  // namespace shardkit::comm

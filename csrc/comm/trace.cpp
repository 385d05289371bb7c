#include "comm/trace.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <thread>

#include "core/collective_identity.h"

namespace shardkit::comm {

namespace {

std::atomic<uint64_t> g_record_ids{0};  // torch's record_id: one count for the process, over all groups

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --- a pickle (protocol 2) of plain values: what the dump is written in -----------------------------------------
// Only the opcodes of builtin values: no global is named, so the file can be read by an unpickler admitting none.
class Pickle {
 public:
  Pickle() { out_ += "\x80\x02"; }  // PROTO 2
  void none() { out_ += 'N'; }
  void boolean(bool v) { out_ += v ? '\x88' : '\x89'; }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';  // BININT1
      out_ += static_cast<char>(v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';  // BININT
      raw(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      out_ += '\x8a';  // LONG1, 8 bytes little-endian two's complement
      out_ += '\x08';
      raw(static_cast<uint64_t>(v), 8);
    }
  }
  void real(double v) {
    out_ += 'G';  // BINFLOAT, big-endian
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
  }
  void string(const std::string& s) {
    out_ += 'X';  // BINUNICODE
    raw(s.size(), 4);
    out_ += s;
  }
  void begin_dict() { out_ += "}("; }     // EMPTY_DICT, MARK
  void end_dict() { out_ += 'u'; }         // SETITEMS
  void begin_list() { out_ += "]("; }      // EMPTY_LIST, MARK
  void end_list() { out_ += 'e'; }         // APPENDS
  void begin_tuple() { out_ += '('; }      // MARK
  void end_tuple() { out_ += 't'; }        // TUPLE
  void key(const char* k) { string(k); }
  std::string finish() {
    out_ += '.';  // STOP
    return std::move(out_);
  }

 private:
  void raw(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

// torch's names of the ops (the `profiling_name`s of its flight recorder), from shardkit's (OpContext::op).
const char* torch_name(const TraceEntry& e) {
  const std::string op = e.op;
  const bool one = e.outputs.count <= 1;
  if (op == "allreduce") return "all_reduce";
  if (op == "all_gather_into_tensor") return one ? "_all_gather_base" : "all_gather_into_tensor_coalesced";
  if (op == "reduce_scatter_tensor") return one ? "_reduce_scatter_base" : "reduce_scatter_tensor_coalesced";
  if (op == "allgather") return "all_gather";
  if (op == "all_gather_coalesced") return "ALLGATHER_coalesced";
  return e.op;  // broadcast, reduce, reduce_scatter, gather, scatter, all_to_all(_single), barrier, allreduce_coalesced,
                // shared_buffer (shardkit's own)
}

const char* state_name(TraceState s) {
  switch (s) {
    case TraceState::kScheduled: return "scheduled";
    case TraceState::kStarted: return "started";
    case TraceState::kCompleted: return "completed";
    case TraceState::kFailed: return "failed";
    default: return "empty";
  }
}

void write_tensors(Pickle& p, const TracedTensors& t, bool sizes) {
  p.begin_list();
  const int shown = std::min(t.count, kTracedTensors);
  for (int i = 0; i < shown; ++i) {
    if (sizes) {
      p.begin_list();
      for (int d = 0; d < t.ndim[i]; ++d) p.integer(t.dims[i * kTracedDims + d]);
      p.end_list();
    } else {
      p.string(c10::toString(static_cast<c10::ScalarType>(t.dtype[i])));
    }
  }
  p.end_list();
}

std::optional<int64_t> ns_or_none(int64_t ns) { return ns == 0 ? std::nullopt : std::optional<int64_t>(ns); }

void optional_int(Pickle& p, std::optional<int64_t> v) {
  if (v) {
    p.integer(*v);
  } else {
    p.none();
  }
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

struct RingView {
  TraceRing::Group group;
  std::vector<TraceEntry> entries;
};

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

std::string render(const std::vector<RingView>& rings, int global_rank, const std::string& reason) {
  Pickle p;
  p.begin_dict();
  p.key("version");
  p.string("2.10");  // the layout of torch's FlightRecorder.hpp this file follows
  p.key("shardkit_version");
  p.integer(1);
  p.key("shardkit_rank");
  p.integer(global_rank);
  p.key("shardkit_reason");
  p.string(reason);
  p.key("shardkit_pid");
  p.integer(getpid());
  p.key("shardkit_host");
  p.string(hostname());
  p.key("shardkit_dumped_ns");
  p.integer(now_ns());
  p.key("pg_config");
  p.begin_dict();
  for (const auto& ring : rings) {
    p.key(ring.group.name.c_str());
    p.begin_dict();
    p.key("name");
    p.string(ring.group.name);
    p.key("desc");
    p.string(ring.group.description);
    p.key("ranks");
    p.string(ranks_text(ring.group.ranks));
    p.end_dict();
  }
  p.end_dict();
  p.key("pg_status");
  p.begin_dict();
  for (const auto& ring : rings) {
    int64_t enqueued = 0, started = 0, completed = 0;
    for (const auto& e : ring.entries) {
      enqueued = std::max<int64_t>(enqueued, e.issued);
      if (e.seq) started = std::max<int64_t>(started, e.seq);
      if (e.state == TraceState::kCompleted) completed = std::max<int64_t>(completed, e.seq);
    }
    p.key(ring.group.name.c_str());
    p.begin_dict();
    p.key("last_enqueued_collective");
    p.integer(enqueued);
    p.key("last_started_collective");
    p.integer(started);
    p.key("last_completed_collective");
    p.integer(completed);
    p.end_dict();
  }
  p.end_dict();
  p.key("entries");
  p.begin_list();
  std::vector<std::pair<const TraceEntry*, size_t>> all;  // every group's entries, in record order
  for (size_t g = 0; g < rings.size(); ++g) {
    for (const auto& e : rings[g].entries) all.emplace_back(&e, g);
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first->record_id < b.first->record_id; });
  for (const auto& [entry, g] : all) {
    const TraceEntry& e = *entry;
    const TraceRing::Group& group = rings[g].group;
    const int64_t seq = static_cast<int64_t>(e.seq ? e.seq : e.issued);
    p.begin_dict();
    p.key("record_id");
    p.integer(static_cast<int64_t>(e.record_id));
    p.key("pg_id");
    p.integer(static_cast<int64_t>(g));
    p.key("process_group");
    p.begin_tuple();
    p.string(group.name);
    p.string(group.description);
    p.end_tuple();
    p.key("collective_seq_id");
    p.integer(seq);
    p.key("p2p_seq_id");
    p.integer(0);
    p.key("op_id");
    p.integer(seq);
    p.key("is_p2p");
    p.boolean(false);
    p.key("profiling_name");
    p.string(std::string("shardkit:") + torch_name(e));
    p.key("time_created_ns");
    p.integer(e.created_ns);
    p.key("input_sizes");
    write_tensors(p, e.inputs, true);
    p.key("input_dtypes");
    write_tensors(p, e.inputs, false);
    p.key("output_sizes");
    write_tensors(p, e.outputs, true);
    p.key("output_dtypes");
    write_tensors(p, e.outputs, false);
    p.key("state");
    p.string(state_name(e.state));
    p.key("timeout_ms");
    p.integer(e.timeout_ms);
    p.key("duration_ms");
    if (e.started_ns && e.ended_ns) {
      p.real(static_cast<double>(e.ended_ns - e.started_ns) / 1e6);
    } else {
      p.none();
    }
    p.key("time_discovered_started_ns");
    optional_int(p, ns_or_none(e.started_ns));
    p.key("time_discovered_completed_ns");
    optional_int(p, ns_or_none(e.ended_ns));
    p.key("retired");
    p.boolean(e.state == TraceState::kCompleted || e.state == TraceState::kFailed);
    p.key("frames");
    p.begin_list();
    p.end_list();
    p.key("shardkit_op");
    p.string(e.op);
    p.key("shardkit_issued");
    p.integer(static_cast<int64_t>(e.issued));
    p.key("shardkit_unit");
    if (e.identity) {
      p.string(core::describe_identity(e.identity));
    } else {
      p.none();
    }
    p.key("shardkit_input_tensors");
    p.integer(e.inputs.count);
    p.key("shardkit_output_tensors");
    p.integer(e.outputs.count);
    p.end_dict();
  }
  p.end_list();
  p.end_dict();
  return p.finish();
}

// The registry's state: a leaked singleton's members would outlive nothing; this one is owned by a static whose
// destructor stops and joins the dumper thread.
struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<TraceRing>> rings;
  std::vector<const TraceRing*> keys;
  std::mutex dump_mutex;  // one dump at a time (their files would race on the temporary name)
  // SIGUSR1
  std::mutex signal_mutex;
  bool signal_tried = false;
  bool signal_ours = false;
  sem_t wake;
  std::atomic<bool> stopping{false};
  // The dumper thread, joined at exit by the process that started it. A process forked from it has no such thread:
  // it leaves the object alone (joining or destroying it there would be undefined, or terminate).
  std::thread* dumper = nullptr;
  pid_t dumper_owner = 0;

  Registry() { sem_init(&wake, 0, 0); }
  ~Registry() {
    if (dumper != nullptr && getpid() == dumper_owner) {
      stopping = true;
      sem_post(&wake);
      dumper->join();
      delete dumper;
    }
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

void on_sigusr1(int) {
  // Async-signal-safe: only sem_post. The dumper thread writes the file.
  sem_post(&registry().wake);
}

void dumper_loop() {
  Registry& r = registry();
  while (!r.stopping) {
    // Each wait has a deadline (a second), after which it looks at `stopping` and waits again.
    timespec until{};
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    if (sem_timedwait(&r.wake, &until) != 0) {
      if (errno == EINTR || errno == ETIMEDOUT) continue;
      return;
    }
    if (r.stopping) return;
    try {
      const std::string path = TraceRegistry::dump("SIGUSR1");
      std::cerr << "shardkit flight recorder: SIGUSR1: trace written to " << path << std::endl;
    } catch (const std::exception& error) {
      std::cerr << "shardkit flight recorder: SIGUSR1: could not write the trace: " << error.what() << std::endl;
    }
  }
}

}  // namespace

// --- TracedTensors / TraceRing -----------------------------------------------------------------------------------

void TracedTensors::set(const std::vector<at::Tensor>& tensors) {
  count = static_cast<int32_t>(tensors.size());
  const int shown = std::min<int>(count, kTracedTensors);
  for (int i = 0; i < shown; ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined()) {
      ndim[i] = 0;
      dtype[i] = static_cast<int8_t>(c10::ScalarType::Undefined);
      continue;
    }
    dtype[i] = static_cast<int8_t>(t.scalar_type());
    const auto sizes = t.sizes();
    if (sizes.size() <= static_cast<size_t>(kTracedDims)) {
      ndim[i] = static_cast<int8_t>(sizes.size());
      for (size_t d = 0; d < sizes.size(); ++d) dims[i * kTracedDims + d] = sizes[d];
    } else {
      ndim[i] = 1;
      dims[i * kTracedDims] = t.numel();
    }
  }
}

TraceRing::TraceRing(size_t capacity, std::function<Group()> describe)
    : slots_(capacity), describe_(std::move(describe)) {}

uint64_t TraceRing::issued(const char* op, uint64_t issued, uint64_t identity, std::chrono::milliseconds timeout,
                           const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  if (slots_.empty()) return 0;
  TraceEntry entry;  // filled outside the lock; copied into its slot inside it
  entry.issued = issued;
  entry.op = op;
  entry.identity = identity;
  entry.timeout_ms = timeout.count();
  entry.created_ns = now_ns();
  entry.state = TraceState::kScheduled;
  entry.inputs.set(inputs);
  entry.outputs.set(outputs);
  std::lock_guard<std::mutex> lock(mutex_);
  entry.ticket = ++next_;
  entry.record_id = g_record_ids.fetch_add(1, std::memory_order_relaxed);
  slots_[(entry.ticket - 1) % slots_.size()] = entry;
  return entry.ticket;
}

TraceEntry* TraceRing::slot(uint64_t ticket) {
  TraceEntry& e = slots_[(ticket - 1) % slots_.size()];
  return e.ticket == ticket ? &e : nullptr;
}

void TraceRing::started(uint64_t ticket, uint64_t seq) {
  if (ticket == 0) return;
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (TraceEntry* e = slot(ticket)) {
    e->seq = seq;
    e->started_ns = now;
    e->state = TraceState::kStarted;
  }
}

void TraceRing::ended(uint64_t ticket, bool ok) {
  if (ticket == 0) return;
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (TraceEntry* e = slot(ticket)) {
    e->ended_ns = now;
    e->state = ok ? TraceState::kCompleted : TraceState::kFailed;
  }
}

std::vector<TraceEntry> TraceRing::entries() const {
  std::vector<TraceEntry> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.reserve(std::min<uint64_t>(next_, slots_.size()));
  const uint64_t first = next_ > slots_.size() ? next_ - slots_.size() + 1 : 1;
  for (uint64_t ticket = first; ticket <= next_; ++ticket) out.push_back(slots_[(ticket - 1) % slots_.size()]);
  return out;
}

bool TraceRing::claim_failure_dump(const std::string& path) {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  if (failure_dumped_) return false;
  failure_dumped_ = true;
  failure_path_ = path;
  return true;
}

std::string TraceRing::failure_dump() {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  return failure_path_;
}

double trace_cost_ns(int64_t iterations, size_t capacity) {
  TraceRing ring(capacity, [] { return TraceRing::Group{}; });
  const std::vector<at::Tensor> tensors{at::ones({1024})};
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 1; i <= iterations; ++i) {
    const uint64_t ticket = ring.issued("allreduce", static_cast<uint64_t>(i), 0, std::chrono::milliseconds(1000),
                                        tensors, tensors);
    ring.started(ticket, static_cast<uint64_t>(i));
    ring.ended(ticket, true);
  }
  const auto spent = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  return iterations > 0 ? spent / static_cast<double>(iterations) : 0.0;
}

// --- settings ----------------------------------------------------------------------------------------------------

size_t trace_capacity() {
  const char* raw = std::getenv("SHARDKIT_TRACE_BUFFER");
  if (raw == nullptr || *raw == '\0') return 2000;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(raw, &end, 10);
  TORCH_CHECK(errno == 0 && end != raw && *end == '\0' && value >= 0 && value <= 10'000'000,
              "shardkit: SHARDKIT_TRACE_BUFFER must be a count of collectives from 0 (off) to 10000000, got '", raw,
              "'");
  return static_cast<size_t>(value);
}

std::string trace_dir() {
  if (const char* dir = std::getenv("SHARDKIT_TRACE_DIR"); dir != nullptr && *dir != '\0') return dir;
  std::string tmp = "/tmp";
  for (const char* name : {"TMPDIR", "TEMP", "TMP"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      tmp = value;
      break;
    }
  }
  std::string job = "job";
  if (const char* run = std::getenv("TORCHELASTIC_RUN_ID"); run != nullptr && *run != '\0' && std::string(run) != "none") {
    job = run;
  } else if (const char* port = std::getenv("MASTER_PORT"); port != nullptr && *port != '\0') {
    job = std::string("port-") + port;
  }
  for (char& c : job) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  }
  return tmp + "/shardkit_traces/" + job;
}

// --- TraceRegistry -------------------------------------------------------------------------------------------------

void TraceRegistry::add(const std::shared_ptr<TraceRing>& ring) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.rings.push_back(ring);
  r.keys.push_back(ring.get());
}

void TraceRegistry::remove(const TraceRing* ring) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (size_t i = 0; i < r.keys.size(); ++i) {
    if (r.keys[i] == ring) {
      r.keys.erase(r.keys.begin() + static_cast<std::ptrdiff_t>(i));
      r.rings.erase(r.rings.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

namespace {
// Every live ring's group and entries. Under the registry's lock: a group leaves the registry (its destructor) only
// between dumps, so describe() never reaches a destroyed backend.
std::vector<RingView> snapshot(int* global_rank) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<RingView> views;
  for (const auto& weak : r.rings) {
    if (auto ring = weak.lock()) {
      RingView view{ring->describe(), ring->entries()};
      *global_rank = view.group.global_rank;
      views.push_back(std::move(view));
    }
  }
  return views;
}
}  // namespace

void TraceRegistry::dump_to(const std::string& path, const std::string& reason) {
  int global_rank = -1;
  const std::vector<RingView> views = snapshot(&global_rank);
  const std::string bytes = render(views, global_rank, reason);
  std::lock_guard<std::mutex> lock(registry().dump_mutex);
  const std::filesystem::path target(path);
  std::error_code error;
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), error);
  TORCH_CHECK(!error, "shardkit flight recorder: cannot create the trace directory ", target.parent_path().string(),
              ": ", error.message());
  const std::string temporary = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "shardkit flight recorder: cannot write the trace to ", temporary, ": ",
                std::strerror(errno));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    TORCH_CHECK(out.good(), "shardkit flight recorder: writing the trace to ", temporary, " failed: ",
                std::strerror(errno));
  }
  std::filesystem::rename(temporary, target, error);
  TORCH_CHECK(!error, "shardkit flight recorder: cannot move the trace to ", path, ": ", error.message());
}

std::string TraceRegistry::dump(const std::string& reason) {
  int global_rank = -1;
  (void)snapshot(&global_rank);
  TORCH_CHECK(global_rank >= 0, "shardkit flight recorder: no shardkit process group records collectives in this "
              "process (none was created, or SHARDKIT_TRACE_BUFFER=0)");
  const std::string path = trace_dir() + "/shardkit_trace_rank_" + std::to_string(global_rank);
  dump_to(path, reason);
  return path;
}

bool TraceRegistry::install_signal_handler() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.signal_mutex);
  if (r.signal_tried) return r.signal_ours;
  r.signal_tried = true;
  struct sigaction current {};
  if (sigaction(SIGUSR1, nullptr, &current) != 0) return false;
  const bool default_disposition = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
  if (!default_disposition) return false;  // the user's (or Python's) handler, or SIG_IGN: theirs stands
  r.dumper = new std::thread(dumper_loop);
  r.dumper_owner = getpid();
  struct sigaction ours {};
  ours.sa_handler = on_sigusr1;
  sigemptyset(&ours.sa_mask);
  ours.sa_flags = SA_RESTART;
  if (sigaction(SIGUSR1, &ours, nullptr) != 0) return false;
  r.signal_ours = true;
  return true;
}

}  // namespace shardkit::comm

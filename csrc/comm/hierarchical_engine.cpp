#include "comm/hierarchical_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "core/collective_identity.h"
#include "core/reduce.h"

namespace shardkit::comm {

namespace {

// When a gloo step fails (a connection closed), the rank that closed it has usually published why, or its
// host's other ranks will within their liveness check (~0.2 s): wait this long for that root cause.
constexpr auto kRootCauseWait = std::chrono::milliseconds(1000);
// A leader waiting on gloo checks for an abort this often (in-process at once; the Store's notice at this pace).
constexpr auto kNoticeEvery = std::chrono::milliseconds(100);

// Past an op's deadline, how long a wait gives the inner op to end with an error of its own (see wait_inner).
constexpr auto kOwnErrorWait = std::chrono::milliseconds(1000);

// The in-host steps of a collective wait this much longer than its inter-host steps: a local rank that is late
// because its own inter-host step waits on a slow or cut link then times out there first, and its error, which names
// the host it cannot reach, is the group's root cause (not "rank 0 did not arrive" from a peer on its own host). A
// local rank that dies is seen at once (its pid) either way.
constexpr auto kInHostGrace = std::chrono::milliseconds(5000);

// One step of `op` inside the host: it waits for what is left of the op's timeout, plus the grace.
core::CallInfo in_host(const OpContext& op) {
  core::CallInfo call = op.call(true);
  if (call.timeout.count() > 0) call.timeout = op.left() + kInHostGrace;
  return call;
}

// A failed step of an inner gloo backend (as opposed to one of the host's own shm group).
struct InnerStepError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The c10d op that combines hosts' partial results like `op` combines ranks' inputs.
c10d::ReduceOp::RedOpType c10d_op(core::ReduceOp op) {
  switch (op) {
    case core::ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case core::ReduceOp::Product: return c10d::ReduceOp::PRODUCT;
    case core::ReduceOp::Min: return c10d::ReduceOp::MIN;
    case core::ReduceOp::Max: return c10d::ReduceOp::MAX;
    case core::ReduceOp::BAnd: return c10d::ReduceOp::BAND;
    case core::ReduceOp::BOr: return c10d::ReduceOp::BOR;
    case core::ReduceOp::BXor: return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::UNUSED;
}

// gloo has no bool: bools travel as 0/1 bytes, combined with an op that keeps them 0/1 (a sum of bools is
// their OR, a product their AND, as in the shm engine's reduction loops).
c10d::ReduceOp::RedOpType c10d_op_for_bool(core::ReduceOp op) {
  switch (op) {
    case core::ReduceOp::Sum: return c10d::ReduceOp::MAX;
    case core::ReduceOp::Product: return c10d::ReduceOp::MIN;
    default: return c10d_op(op);
  }
}

// The wire formats of an op's data between hosts (OpContext::quantization): only floating data, and for reductions only
// sums, are quantized.
core::QuantFormat gather_wire(const OpContext& op, const at::Tensor& data) {
  return core::quantizable(core_dtype(data)) ? op.quantization.gather : core::QuantFormat{};
}

core::QuantFormat reduce_wire(const OpContext& op, const at::Tensor& data, core::ReduceOp reduce) {
  return core::quantizable(core_dtype(data)) && reduce == core::ReduceOp::Sum ? op.quantization.reduce
                                                                             : core::QuantFormat{};
}

// How one op's runs of values travel between hosts: as they are, or as records of `format` (core/quantize.h).
class Wire {
 public:
  Wire(core::QuantFormat format, core::DType dtype) : format_(format), dtype_(dtype) {}

  bool exact() const { return format_.exact(); }
  // What goes on the link for `values`: the values themselves, or their record. With `hold_what_is_sent`, `values`
  // become what the receivers will decode, so that sender and receivers hold the same bits.
  at::Tensor outgoing(const at::Tensor& values, bool hold_what_is_sent = false) const {
    if (exact()) return values;
    at::Tensor record = landing(values);
    core::quantize(values.data_ptr(), numel_of(values), dtype_, format_, record.data_ptr());
    if (hold_what_is_sent) core::dequantize(record.data_ptr(), numel_of(values), dtype_, format_, values.data_ptr());
    return record;
  }
  // Where the link leaves what arrives for `values`: `values` themselves, or a record for arrived() to decode.
  at::Tensor landing(const at::Tensor& values) const {
    if (exact()) return values;
    return at::empty({static_cast<int64_t>(core::quantized_bytes(numel_of(values), format_))}, at::kByte);
  }
  void arrived(const at::Tensor& landing, const at::Tensor& values) const {
    if (!exact()) core::dequantize(landing.data_ptr(), numel_of(values), dtype_, format_, values.data_ptr());
  }

 private:
  core::QuantFormat format_;
  core::DType dtype_;
};

}  // namespace

int HostLayout::num_hosts() const { return host_of.empty() ? 0 : *std::max_element(host_of.begin(), host_of.end()) + 1; }

std::vector<int> HostLayout::ranks_of(int host) const {
  std::vector<int> ranks;
  for (size_t r = 0; r < host_of.size(); ++r) {
    if (host_of[r] == host) ranks.push_back(static_cast<int>(r));
  }
  return ranks;  // ascending global rank == local order
}

HierarchicalEngine::HierarchicalEngine(int rank, int size, HostLayout layout, bool rails,
                                       std::unique_ptr<core::ShmGroup> local, std::shared_ptr<InnerBackends> inner,
                                       std::shared_ptr<FailureNotices> notices)
    : rank_(rank),
      size_(size),
      layout_(std::move(layout)),
      host_(layout_.host_of.at(rank)),
      local_rank_(layout_.local_of.at(rank)),
      max_local_size_(0),
      rails_(rails),
      local_(std::move(local)),
      inner_(std::move(inner)),
      notices_(std::move(notices)) {
  for (int h = 0; h < layout_.num_hosts(); ++h) {
    hosts_.push_back(layout_.ranks_of(h));
    max_local_size_ = std::max(max_local_size_, static_cast<int>(hosts_.back().size()));
  }
  if (rails_) {  // the creator's promise (backend.h): equal hosts of consecutive ranks, two or more each
    for (const std::vector<int>& ranks : hosts_) {
      TORCH_CHECK(static_cast<int>(ranks.size()) == max_local_size_ && ranks.size() >= 2 &&
                      ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size()),
                  "shardkit (rank ", rank, "): rails need hosts of equal numbers (2+) of consecutive ranks");
    }
  }
}

template <typename Steps>
void HierarchicalEngine::guarded(const OpContext& op, std::optional<LeaderStep> step, Steps steps) {
  if (const std::string reason = aborted_reason(); !reason.empty()) {
    throw std::runtime_error(op.where() + "group was aborted earlier: " + reason);
  }
  try {
    if (step && leader() && op.compare_across_hosts) start_fingerprint(op, *step);
    steps();
    settle_fingerprint(op);  // an op whose leaders moved no bytes between hosts (empty tensors) still agrees
  } catch (const InnerStepError& error) {
    abandon_fingerprint();
    abort_everywhere(op, error.what(), /*await_root_cause=*/true);
  } catch (const std::exception& error) {
    abandon_fingerprint();
    abort_everywhere(op, message_of(error), /*await_root_cause=*/false);
  }
}

std::string HierarchicalEngine::aborted_reason() const {
  if (!is_aborted_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return aborted_;
}

bool HierarchicalEngine::abort_here(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (is_aborted_.load(std::memory_order_relaxed)) return false;
    aborted_ = reason;
    is_aborted_.store(true, std::memory_order_release);
  }
  local_->abort(reason);  // wakes this host's ranks (no-op if the shm group aborted itself)
  inner_->close(reason);  // closes the gloo connections: blocked peers on other hosts fail now
  return true;
}

void HierarchicalEngine::abort(const std::string& reason) {
  if (!abort_here(reason)) return;
  // Peers on other hosts read it (once their connection drops, or at their next look at the Store); written on a
  // thread of its own, so that an abort from another group's failure never waits for the Store.
  std::thread([notices = notices_, reason] { notices->publish(reason); }).detach();
}

void HierarchicalEngine::abort_everywhere(const OpContext& op, const std::string& reason, bool await_root_cause) {
  std::optional<std::string> cause;  // another rank's reason, which this failure only follows from
  std::string mine = reason;
  if (await_root_cause) {
    // Said first, so that leaders waiting for a root cause at the same time see each other's hosts as alive.
    notices_->mark_failed(reason);
    cause = notices_->await_root_cause(kRootCauseWait);
    if (!cause) {
      if (const std::string silent = notices_->silent_ranks(); !silent.empty()) {
        mine += "; rank(s) " + silent + " went silent: no rank of their host(s) reported a failure within " +
                std::to_string(kRootCauseWait.count()) + " ms (they exited or were killed, lost the network, or are "
                "not in this collective)";
      }
    }
  }
  if (!cause) {  // (a cause found above: this rank has marked itself failed already, and the notice stands)
    if (const std::string first = notices_->publish(mine); first != mine) cause = first;
  }
  const std::string message = cause ? op.where() + "group aborted: " + *cause : mine;
  abort_here(message);
  throw std::runtime_error(message);
}

void HierarchicalEngine::wait_inner(const OpContext& op, const char* step, c10::intrusive_ptr<c10d::Backend>& backend,
                                    const c10::intrusive_ptr<c10d::Work>& work) {
  using clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  const auto deadline = op.deadline();  // the op's, shared by all its steps
  // In slices: a completed op ends a slice at once (the Work's condition variable); between slices, this rank
  // looks for an abort (another group of the process failed) and for the group's notice (a rank elsewhere did).
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - clock::now());
    try {
      work->wait(std::clamp(left, milliseconds(1), std::chrono::duration_cast<milliseconds>(kNoticeEvery)));
      return;
    } catch (const std::exception& error) {
      // Only this slice ended, the op failed, or the deadline passed (the op still in flight: abandoned). An op that
      // completed just after its slice timed out is judged by its own outcome, not by the slice's "timed out".
      if (work->isCompleted()) {
        try {
          work->wait();
          return;
        } catch (const std::exception& failure) {
          throw InnerStepError(op.where() + step + " failed: " + message_of(failure));
        }
      }
      if (clock::now() >= deadline) {
        // The inner op waits to the same deadline (an exchange's peers, start_exchange): a moment more lets it end
        // with its own error, which names the peer it could not reach, rather than with a bare "timed out".
        try {
          work->wait(kOwnErrorWait);
          return;
        } catch (const std::exception& failure) {
          if (work->isCompleted()) throw InnerStepError(op.where() + step + " failed: " + message_of(failure));
        }
        InnerBackends::abandon(std::move(backend));
        throw InnerStepError(op.where() + step + " did not finish within the op's timeout of " +
                             std::to_string(op.timeout.count()) + " ms: " + message_of(error));
      }
    }
    std::optional<std::string> cause;
    if (const std::string reason = aborted_reason(); !reason.empty()) {
      cause = reason;
    } else {
      cause = notices_->root_cause();
    }
    if (cause) {
      InnerBackends::abandon(std::move(backend));  // the op may still run on it (see inner_backends.h)
      throw std::runtime_error(op.where() + "group aborted: " + *cause);
    }
  }
}

std::string HierarchicalEngine::Fingerprint::describe() const {
  const Fingerprint& f = *this;
  std::string text = std::string(f.label, strnlen(f.label, sizeof(f.label))) + " #" + std::to_string(f.seq);
  if (static_cast<core::OpKind>(f.kind) != core::OpKind::Barrier) {
    text += std::string(" (") + core::dtype_name(static_cast<core::DType>(f.dtype)) + " x " + std::to_string(f.count) + ")";
  }
  if (f.identity != 0) text += " for " + core::describe_identity(f.identity);
  if (f.gather_wire != 0 || f.reduce_wire != 0) {
    auto format = [](uint32_t packed) {
      return core::QuantFormat{static_cast<core::QuantBits>(packed & 0xFF), packed >> 8}.describe();
    };
    text += ", inter-host bytes: all-gathers " + format(f.gather_wire) + ", sums " + format(f.reduce_wire);
  }
  return text;
}

void HierarchicalEngine::start_fingerprint(const OpContext& op, const LeaderStep& step) {
  PendingFingerprint pending;
  Fingerprint& mine = pending.mine;
  mine.seq = op.seq;
  mine.identity = op.identity;
  mine.count = step.count;
  mine.kind = static_cast<uint32_t>(step.kind);
  mine.dtype = static_cast<uint32_t>(step.dtype);
  auto packed = [](core::QuantFormat format) {
    return format.exact() ? 0u : static_cast<uint32_t>(format.bits) | (format.block << 8);
  };
  mine.gather_wire = packed(op.quantization.gather);
  mine.reduce_wire = packed(op.quantization.reduce);
  std::strncpy(mine.label, op.op, sizeof(mine.label) - 1);
  if (!fingerprint_in_.defined()) {  // the first: the sizes are the group's for good
    fingerprint_in_ = at::empty({static_cast<int64_t>(sizeof(Fingerprint))}, at::kByte);
    fingerprint_everyone_ = at::empty({static_cast<int64_t>(hosts_.size() * sizeof(Fingerprint))}, at::kByte);
  }
  std::memcpy(fingerprint_in_.data_ptr(), &mine, sizeof(Fingerprint));
  c10d::AllgatherOptions options;
  options.timeout = op.timeout;
  pending.backend = inner_->inter_host(op.where());
  pending.work = pending.backend->_allgather_base(fingerprint_everyone_, fingerprint_in_, options);
  fingerprint_ = std::move(pending);
}

void HierarchicalEngine::abandon_fingerprint() {
  if (!fingerprint_) return;
  if (!fingerprint_->work->isCompleted()) InnerBackends::abandon(std::move(fingerprint_->backend));
  fingerprint_.reset();
}

void HierarchicalEngine::settle_fingerprint(const OpContext& op) {
  if (!fingerprint_) return;
  PendingFingerprint pending = std::move(*fingerprint_);
  fingerprint_.reset();
  wait_inner(op, "the host leaders' agreement check (gloo)", pending.backend, pending.work);
  const auto* theirs = static_cast<const Fingerprint*>(fingerprint_everyone_.data_ptr());
  for (size_t h = 0; h < hosts_.size(); ++h) {
    if (std::memcmp(&theirs[h], &pending.mine, sizeof(Fingerprint)) == 0) continue;
    throw std::runtime_error("shardkit: ranks disagree on collective #" + std::to_string(op.seq) + ": rank " +
                             std::to_string(op.global_rank) + " called " + pending.mine.describe() + " but rank " +
                             std::to_string(notices_->global_rank(hosts_[h].front())) + " called " +
                             theirs[h].describe());
  }
}

c10::intrusive_ptr<c10d::Backend> HierarchicalEngine::inter_host_for(const OpContext& op) {
  settle_fingerprint(op);
  return inner_->inter_host(op.where());
}

c10::intrusive_ptr<c10d::Work> HierarchicalEngine::start_allreduce(const OpContext& op, c10d::Backend& backend,
                                                                   at::Tensor& data, core::ReduceOp reduce) {
  const bool is_bool = data.scalar_type() == at::kBool;
  std::vector<at::Tensor> payload{is_bool ? data.view(at::kByte) : data};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(is_bool ? c10d_op_for_bool(reduce) : c10d_op(reduce));
  options.timeout = op.timeout;
  return backend.allreduce(payload, options);
}

namespace {

// The send and receive Works of one exchange, waited for by a thread of their own. A gloo send or receive can only be
// waited for whole (a wait that times out ends it as failed), so that thread waits for them until the op's deadline,
// and this Work's wait(slice) only looks at what it found: wait_inner's slices treat it like gloo's collectives. Should
// the engine give up on it, the thread keeps the Works (and their tensors) until they end or time out. A failure names
// the peer (`peer_of[i]`: who works[i] talks to), which on a cut link is the host this rank cannot reach.
class PointToPointWork : public c10d::Work {
 public:
  PointToPointWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<std::string> peer_of,
                   std::chrono::milliseconds timeout)
      : state_(std::make_shared<State>()) {
    std::thread([state = state_, works = std::move(works), peer_of = std::move(peer_of), timeout] {
      using clock = std::chrono::steady_clock;
      const auto deadline = clock::now() + timeout;
      std::exception_ptr error;
      for (size_t i = 0; i < works.size(); ++i) {
        try {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
          works[i]->wait(std::max(left, std::chrono::milliseconds(1)));
        } catch (const std::exception& failure) {
          if (!error) {
            error = std::make_exception_ptr(std::runtime_error("the exchange with " + peer_of[i] + ": " +
                                                               message_of(failure)));
          }
        }
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->error = error;
      state->done = true;
      state->changed.notify_all();
    }).detach();
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->done;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (timeout == kNoTimeout) {
      state_->changed.wait(lock, [&] { return state_->done; });
    } else if (!state_->changed.wait_for(lock, timeout, [&] { return state_->done; })) {
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
    }
    if (state_->error) std::rethrow_exception(state_->error);
    return true;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
    std::exception_ptr error;
  };
  std::shared_ptr<State> state_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> HierarchicalEngine::start_exchange(const OpContext& op, c10d::Backend& backend,
                                                                  const std::vector<at::Tensor>& to_peer,
                                                                  const std::vector<at::Tensor>& from_peer, int tag) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::string> peer_of;
  for (size_t i = 0; i < to_peer.size(); ++i) {
    // The inter-host backends are ranked by host: peer i is the i-th other host, its rank at this rank's position.
    const int host = static_cast<int>(i) < host_ ? static_cast<int>(i) : static_cast<int>(i) + 1;
    const std::string who = "rank " + std::to_string(notices_->global_rank(hosts_[host][local_rank_])) + " (host " +
                            std::to_string(host) + ")";
    if (from_peer[i].defined()) {
      std::vector<at::Tensor> incoming{as_bytes(from_peer[i])};
      works.push_back(backend.recv(incoming, host, tag));
      peer_of.push_back(who);
    }
    if (to_peer[i].defined()) {
      std::vector<at::Tensor> outgoing{as_bytes(to_peer[i])};
      inter_host_bytes_.fetch_add(to_peer[i].nbytes(), std::memory_order_relaxed);
      works.push_back(backend.send(outgoing, host, tag));
      peer_of.push_back(who);
    }
  }
  return c10::make_intrusive<PointToPointWork>(std::move(works), std::move(peer_of), op.left());
}

namespace {

// The inter-host ops one collective has in flight on its rail at once. Should the collective fail with one still
// running (its backend must then never be destroyed, inner_backends.h), the backend is abandoned.
struct InFlight {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;

  ~InFlight() {
    for (const auto& work : works) {
      if (work && !work->isCompleted()) {
        InnerBackends::abandon(std::move(backend));
        return;
      }
    }
  }
};

// `total` elements in pieces of kRailPieceBytes, the last one shorter: the unit of the rails' pipelines.
struct Pieces {
  Pieces(int64_t total, int64_t element_size)
      : total(total),
        length(std::max<int64_t>(1, static_cast<int64_t>(HierarchicalEngine::kRailPieceBytes) / element_size)),
        count((total + length - 1) / length) {}

  int64_t size(int64_t q) const { return std::min(length, total - q * length); }
  // Piece q of a run of `total` elements.
  at::Tensor of(const at::Tensor& run, int64_t q) const { return run.narrow(0, q * length, size(q)); }

  int64_t total, length, count;
};

}  // namespace

at::Tensor HierarchicalEngine::host_run(const at::Tensor& flat, int host, int64_t block) const {
  return flat.narrow(0, hosts_[host].front() * block, static_cast<int64_t>(max_local_size_) * block);
}

void HierarchicalEngine::leaders_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(data);
  local_->reduce(data.data_ptr(), data.data_ptr(), numel_of(data), dtype, reduce, 0, in_host(op));
  if (leader() && data.numel() > 0) {
    if (!reduce_wire(op, data, reduce).exact()) {
      pipelined_allreduce(op, data, reduce, /*in_host_steps=*/false);
    } else {
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host allreduce (gloo among host leaders)", leaders,
                 start_allreduce(op, *leaders, data, reduce));
    }
  }
  local_->broadcast(data.data_ptr(), numel_of(data), dtype, 0, in_host(op));
}

void HierarchicalEngine::pipelined_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce,
                                             bool in_host_steps) {
  const core::DType dtype = core_dtype(data);
  const Wire wire(reduce_wire(op, data, reduce), dtype);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t ranks_here = in_host_steps ? max_local_size_ : 1;
  const int64_t position = in_host_steps ? local_rank_ : 0;  // this rank's slice of each piece
  const int64_t count = data.numel();
  const int64_t slice = (count + ranks_here - 1) / ranks_here;  // each rank's share of the whole
  // The in-host steps need `ranks_here` equal slices: a count they do not divide works in a padded copy.
  const bool padded = count % ranks_here != 0;
  at::Tensor work = padded ? at::empty({slice * ranks_here}, data.options()) : data.view({-1});
  if (padded) work.narrow(0, 0, count).copy_(data.view({-1}));
  const Pieces slices(slice, data.element_size());  // each rank's slice of every piece
  const int64_t pieces = slices.count;
  auto slice_of = [&](int64_t p) { return slices.size(p); };
  auto piece_of = [&](int64_t p) { return work.narrow(0, p * slices.length * ranks_here, slice_of(p) * ranks_here); };
  auto mine_of = [&](int64_t p) { return piece_of(p).narrow(0, position * slice_of(p), slice_of(p)); };
  // A slice's part j is summed by the rail's rank j (host j), which then sends the sum to the others.
  auto part_of = [&](int64_t p, int j) {
    const int64_t m = slice_of(p);
    return mine_of(p).narrow(0, m * j / hosts, m * (j + 1) / hosts - m * j / hosts);
  };
  std::vector<int> peers;  // the rail's other ranks (hosts), in order
  for (int h = 0; h < hosts; ++h) {
    if (h != host_) peers.push_back(h);
  }
  InFlight rail{nullptr, std::vector<c10::intrusive_ptr<c10d::Work>>(2 * pieces)};
  std::vector<at::Tensor> received(pieces);  // piece p: the other hosts' partial sums of this host's part
  std::vector<std::vector<at::Tensor>> landings(2 * pieces);  // where each exchange's incoming bytes land
  // The three stages of a piece. Tags keep each exchange apart from the others in flight on the same pairs.
  auto scatter_piece = [&](int64_t p) {  // in the host: this rank's slice summed; across: parts to their owners
    if (in_host_steps) {
      at::Tensor piece = piece_of(p);
      local_->reduce_scatter(piece.data_ptr(), mine_of(p).data_ptr(), static_cast<size_t>(slice_of(p)), dtype, reduce,
                             in_host(op));
    }
    if (p == 0) rail.backend = inter_host_for(op);  // (a leader: after the fingerprint, which ran meanwhile)
    const int64_t own = part_of(p, host_).numel();
    received[p] = at::empty({(hosts - 1) * own}, data.options());
    std::vector<at::Tensor> to_peer;
    for (int h : peers) to_peer.push_back(wire.outgoing(part_of(p, h)));
    for (int i = 0; i < hosts - 1; ++i) landings[2 * p].push_back(wire.landing(received[p].narrow(0, i * own, own)));
    rail.works[2 * p] = start_exchange(op, *rail.backend, to_peer, landings[2 * p], static_cast<int>(2 * p));
  };
  auto reduce_piece = [&](int64_t p) {  // this host's part summed over the hosts, in host order; sent to all
    wait_inner(op, "the inter-host reduce-scatter step of an allreduce (gloo on the rails)", rail.backend,
               rail.works[2 * p]);
    at::Tensor own = part_of(p, host_);
    std::vector<const void*> sums;
    for (int h = 0, i = 0; h < hosts; ++h) {
      if (h == host_) {
        sums.push_back(own.data_ptr());
        continue;
      }
      at::Tensor theirs = received[p].narrow(0, i * own.numel(), own.numel());
      wire.arrived(landings[2 * p][i++], theirs);
      sums.push_back(theirs.data_ptr());
    }
    core::reduce_into(own.data_ptr(), sums.data(), hosts, numel_of(own), dtype, reduce);
    received[p] = at::Tensor();
    landings[2 * p].clear();
    std::vector<at::Tensor> to_peer(hosts - 1, wire.outgoing(own, /*hold_what_is_sent=*/true));
    for (int h : peers) landings[2 * p + 1].push_back(wire.landing(part_of(p, h)));
    rail.works[2 * p + 1] = start_exchange(op, *rail.backend, to_peer, landings[2 * p + 1], static_cast<int>(2 * p + 1));
  };
  auto gather_piece = [&](int64_t p) {  // the hosts' sums in, then shared in the host
    wait_inner(op, "the inter-host all-gather step of an allreduce (gloo on the rails)", rail.backend,
               rail.works[2 * p + 1]);
    for (size_t i = 0; i < peers.size(); ++i) wire.arrived(landings[2 * p + 1][i], part_of(p, peers[i]));
    landings[2 * p + 1].clear();
    if (in_host_steps) {
      at::Tensor piece = piece_of(p);
      local_->allgather(mine_of(p).data_ptr(), piece.data_ptr(), static_cast<size_t>(slice_of(p)), dtype,
                        in_host(op));
    }
  };
  // Pipelined: a piece's in-host steps run while the pieces before it are on the link.
  for (int64_t p = 0; p < pieces + 2; ++p) {
    if (p < pieces) scatter_piece(p);
    if (p >= 1 && p - 1 < pieces) reduce_piece(p - 1);
    if (p >= 2) gather_piece(p - 2);
  }
  if (padded) data.view({-1}).copy_(work.narrow(0, 0, count));
}

void HierarchicalEngine::barrier(const OpContext& op) {
  guarded(op, LeaderStep{core::OpKind::Barrier, 0, core::DType::U8}, [&] {
    local_->barrier(in_host(op));
    if (leader()) {
      c10d::BarrierOptions options;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host barrier (gloo among host leaders)", leaders, leaders->barrier(options));
    }
    local_->barrier(in_host(op));  // nobody leaves before every host's leader has passed the inter-host step
  });
}

void HierarchicalEngine::broadcast(const OpContext& op, at::Tensor& data, int root) {
  guarded(op, LeaderStep{core::OpKind::Broadcast, numel_of(data), core_dtype(data)}, [&] {
    const int root_host = layout_.host_of[root];
    const core::DType dtype = core_dtype(data);
    if (host_ == root_host) local_->broadcast(data.data_ptr(), numel_of(data), dtype, layout_.local_of[root], in_host(op));
    if (leader() && data.numel() > 0) {
      std::vector<at::Tensor> payload{as_bytes(data)};
      c10d::BroadcastOptions options;
      options.rootRank = root_host;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host broadcast (gloo among host leaders)", leaders, leaders->broadcast(payload, options));
    }
    if (host_ != root_host) local_->broadcast(data.data_ptr(), numel_of(data), dtype, 0, in_host(op));
  });
}

void HierarchicalEngine::allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  guarded(op, LeaderStep{core::OpKind::AllReduce, numel_of(data), core_dtype(data)}, [&] {
    if (use_rails(data.nbytes())) {
      pipelined_allreduce(op, data, reduce, /*in_host_steps=*/true);
    } else {
      leaders_allreduce(op, data, reduce);
    }
  });
}

void HierarchicalEngine::reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) {
  guarded(op, LeaderStep{core::OpKind::Reduce, numel_of(data), core_dtype(data)}, [&] {
    const core::DType dtype = core_dtype(data);
    const int root_host = layout_.host_of[root];
    // The leader's partial result goes to a scratch buffer unless the leader is root: every rank's
    // tensor but root's must stay as it was.
    at::Tensor partial;
    if (leader()) partial = rank_ == root ? data : at::empty_like(data);
    local_->reduce(data.data_ptr(), partial.defined() ? partial.data_ptr() : nullptr, numel_of(data), dtype, reduce,
                   0, in_host(op));
    const Wire wire(reduce_wire(op, data, reduce), dtype);
    if (leader() && data.numel() > 0 && !wire.exact()) {
      // Quantized: every other host's leader sends its partial sum's record to root's host's leader, which sums
      // the hosts' partial sums in host order (its own exact).
      const int hosts = static_cast<int>(hosts_.size());
      std::vector<at::Tensor> to_peer(hosts - 1), from_peer(hosts - 1), theirs(hosts - 1);  // undefined: no transfer
      if (host_ == root_host) {
        for (int i = 0; i < hosts - 1; ++i) {
          theirs[i] = at::empty_like(partial);
          from_peer[i] = wire.landing(theirs[i]);
        }
      } else {
        to_peer[root_host < host_ ? root_host : root_host - 1] = wire.outgoing(partial);
      }
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce (gloo among host leaders)", leaders,
                 start_exchange(op, *leaders, to_peer, from_peer));
      if (host_ == root_host) {
        std::vector<const void*> sums;
        for (int h = 0, i = 0; h < hosts; ++h) {
          if (h == host_) {
            sums.push_back(partial.data_ptr());
            continue;
          }
          wire.arrived(from_peer[i], theirs[i]);
          sums.push_back(theirs[i++].data_ptr());
        }
        core::reduce_into(partial.data_ptr(), sums.data(), hosts, numel_of(partial), dtype, reduce);
      }
    } else if (leader() && data.numel() > 0) {
      const bool is_bool = data.scalar_type() == at::kBool;
      std::vector<at::Tensor> payload{is_bool ? partial.view(at::kByte) : partial};
      c10d::ReduceOptions options;
      options.reduceOp = c10d::ReduceOp(is_bool ? c10d_op_for_bool(reduce) : c10d_op(reduce));
      options.rootRank = root_host;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce (gloo among host leaders)", leaders, leaders->reduce(payload, options));
    }
    if (host_ == root_host && layout_.local_of[root] != 0) {
      // Hand the result from the leader to root; the host's other ranks receive it into scratch.
      at::Tensor landing = rank_ == root ? data : (leader() ? partial : at::empty_like(data));
      local_->broadcast(landing.data_ptr(), numel_of(landing), dtype, 0, in_host(op));
    }
  });
}

void HierarchicalEngine::allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  guarded(op, LeaderStep{core::OpKind::AllGather, numel_of(input), core_dtype(input)}, [&] {
    if (use_rails(output.nbytes())) {
      rails_allgather(op, input, output);
    } else {
      leaders_allgather(op, input, output);
    }
  });
}

void HierarchicalEngine::leaders_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  const core::DType dtype = core_dtype(input);
  const int64_t n = input.numel();
  const int64_t block = static_cast<int64_t>(max_local_size_) * n;  // a host's share, padded to the largest host
  at::Tensor host_block;
  if (leader()) host_block = at::empty({block}, input.options());
  local_->gather(input.data_ptr(), leader() ? host_block.data_ptr() : nullptr, static_cast<size_t>(n), dtype, 0,
                 in_host(op));
  const core::QuantFormat format = gather_wire(op, input);
  if (leader() && n > 0 && !format.exact()) {
    // Each rank's block is quantized on its own, so its record decodes to the same values wherever it lands; the
    // leaders exchange their hosts' records and every host's are decoded into place, this host's too.
    const int hosts = static_cast<int>(hosts_.size());
    const int64_t record = static_cast<int64_t>(core::quantized_bytes(static_cast<size_t>(n), format));
    const int64_t host_records = max_local_size_ * record;
    at::Tensor records = at::empty({hosts * host_records}, at::kByte);  // every host's, in host order
    auto record_of = [&](int h, int64_t l) { return records.narrow(0, h * host_records + l * record, record); };
    for (size_t l = 0; l < hosts_[host_].size(); ++l) {
      core::quantize(host_block.narrow(0, static_cast<int64_t>(l) * n, n).data_ptr(), static_cast<size_t>(n), dtype,
                     format, record_of(host_, static_cast<int64_t>(l)).data_ptr());
    }
    std::vector<at::Tensor> to_peer, from_peer;
    for (int h = 0; h < hosts; ++h) {
      if (h == host_) continue;
      to_peer.push_back(records.narrow(0, host_ * host_records, host_records));
      from_peer.push_back(records.narrow(0, h * host_records, host_records));
    }
    c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
    wait_inner(op, "the inter-host all-gather (gloo among host leaders)", leaders,
               start_exchange(op, *leaders, to_peer, from_peer));
    at::Tensor flat = output.view({-1});
    for (int h = 0; h < hosts; ++h) {
      for (size_t l = 0; l < hosts_[h].size(); ++l) {
        core::dequantize(record_of(h, static_cast<int64_t>(l)).data_ptr(), static_cast<size_t>(n), dtype, format,
                         flat.narrow(0, hosts_[h][l] * n, n).data_ptr());
      }
    }
  } else if (leader()) {
    const int64_t hosts = static_cast<int64_t>(hosts_.size());
    at::Tensor all_hosts = at::empty({block * hosts}, input.options());
    if (n > 0) {
      at::Tensor out_bytes = as_bytes(all_hosts);
      at::Tensor in_bytes = as_bytes(host_block);
      c10d::AllgatherOptions options;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host all-gather (gloo among host leaders)", leaders,
                 leaders->_allgather_base(out_bytes, in_bytes, options));
    }
    at::Tensor flat = output.view({-1});
    for (int64_t h = 0; h < hosts; ++h) {
      const std::vector<int>& ranks = hosts_[h];
      for (size_t l = 0; l < ranks.size(); ++l) {
        flat.narrow(0, ranks[l] * n, n).copy_(all_hosts.narrow(0, h * block + static_cast<int64_t>(l) * n, n));
      }
    }
  }
  local_->broadcast(output.data_ptr(), numel_of(output), dtype, 0, in_host(op));
}

void HierarchicalEngine::rails_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = input.numel();
  at::Tensor flat = output.view({-1});
  const Wire wire(gather_wire(op, input), dtype);
  // What this host shares of this rank's input: the input, or (quantized) what the other hosts decode of it, so
  // that every rank holds the same bits.
  at::Tensor in = wire.exact() ? input.reshape({-1}) : input.reshape({-1}).clone();
  const Pieces pieces(n, input.element_size());
  // Each other host's block at this rank's position arrives straight into its place in `output`; the in-host
  // all-gather of that host's blocks then leaves it where it is (in place).
  std::vector<at::Tensor> from_host;
  for (int h = 0; h < hosts; ++h) {
    if (h != host_) from_host.push_back(host_run(flat, h, n).narrow(0, local_rank_ * n, n));
  }
  // Every piece's exchange is posted at once (the link takes them in order); this host's in-host all-gather runs
  // meanwhile, then each other host's pieces are shared in the host as they arrive.
  InFlight rail{inter_host_for(op), {}};
  std::vector<std::vector<at::Tensor>> landings(pieces.count);
  for (int64_t q = 0; q < pieces.count; ++q) {
    std::vector<at::Tensor> to_peer(hosts - 1, wire.outgoing(pieces.of(in, q), /*hold_what_is_sent=*/true));
    for (const at::Tensor& block : from_host) landings[q].push_back(wire.landing(pieces.of(block, q)));
    rail.works.push_back(start_exchange(op, *rail.backend, to_peer, landings[q], static_cast<int>(q)));
  }
  local_->allgather(in.data_ptr(), host_run(flat, host_, n).data_ptr(), static_cast<size_t>(n), dtype, in_host(op));
  for (int64_t q = 0; q < pieces.count; ++q) {
    wait_inner(op, "the inter-host all-gather (gloo on the rails)", rail.backend, rail.works[q]);
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h == host_) continue;
      wire.arrived(landings[q][peer], pieces.of(from_host[peer], q));
      local_->allgather_strided(pieces.of(from_host[peer++], q).data_ptr(), pieces.of(host_run(flat, h, n), q).data_ptr(),
                                static_cast<size_t>(pieces.size(q)), static_cast<size_t>(n), dtype, in_host(op));
    }
  }
}

void HierarchicalEngine::reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                        core::ReduceOp reduce) {
  guarded(op, LeaderStep{core::OpKind::ReduceScatter, numel_of(output), core_dtype(output)}, [&] {
    if (use_rails(input.nbytes())) {
      rails_reduce_scatter(op, input, output, reduce);
    } else {
      leaders_reduce_scatter(op, input, output, reduce);
    }
  });
}

void HierarchicalEngine::leaders_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                                core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = output.numel();
  const std::vector<int>& mine = hosts_[host_];
  const int64_t host_count = static_cast<int64_t>(mine.size()) * n;
  const int64_t block = static_cast<int64_t>(max_local_size_) * n;  // a host's blocks, padded to the largest host
  at::Tensor host_blocks;  // the leader's: this host's ranks' blocks summed over every host, in local order
  if (!leader()) {
    local_->reduce(input.data_ptr(), nullptr, numel_of(input), dtype, reduce, 0, in_host(op));
  } else {
    at::Tensor partial = at::empty_like(input);
    local_->reduce(input.data_ptr(), partial.data_ptr(), numel_of(input), dtype, reduce, 0, in_host(op));
    at::Tensor flat = partial.view({-1});
    // Each other host gets this host's partial sums of its ranks' blocks; theirs of this host's ranks come back.
    // (Zeros: a smaller host's padding must not weigh in a quantized block's scale.)
    at::Tensor send = at::zeros({(hosts - 1) * block}, input.options());
    at::Tensor received = at::empty({(hosts - 1) * block}, input.options());
    at::Tensor own = at::empty({host_count}, input.options());
    std::vector<const void*> sums;  // this host's blocks as each host summed them, in host order
    for (int h = 0, peer = 0; h < hosts; ++h) {
      at::Tensor to = h == host_ ? own : send.narrow(0, peer * block, block);
      for (size_t l = 0; l < hosts_[h].size(); ++l) {
        to.narrow(0, static_cast<int64_t>(l) * n, n).copy_(flat.narrow(0, hosts_[h][l] * n, n));
      }
      sums.push_back(h == host_ ? own.data_ptr() : received.narrow(0, (peer++) * block, host_count).data_ptr());
    }
    host_blocks = own;
    if (n > 0) {
      const Wire wire(reduce_wire(op, input, reduce), dtype);
      const std::vector<at::Tensor> to_host = send.chunk(hosts - 1), from_host = received.chunk(hosts - 1);
      std::vector<at::Tensor> to_peer, from_peer;
      for (int i = 0; i < hosts - 1; ++i) {
        to_peer.push_back(wire.outgoing(to_host[i]));
        from_peer.push_back(wire.landing(from_host[i]));
      }
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce-scatter (gloo among host leaders)", leaders,
                 start_exchange(op, *leaders, to_peer, from_peer));
      for (int i = 0; i < hosts - 1; ++i) wire.arrived(from_peer[i], from_host[i]);
      host_blocks = at::empty({host_count}, input.options());
      core::reduce_into(host_blocks.data_ptr(), sums.data(), hosts, static_cast<size_t>(host_count), dtype, reduce);
    }
  }
  local_->scatter(leader() ? host_blocks.data_ptr() : nullptr, output.data_ptr(), static_cast<size_t>(n), dtype, 0,
                  in_host(op));
}

void HierarchicalEngine::rails_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                              core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = output.numel();
  at::Tensor flat = input.reshape({-1});
  at::Tensor out = output.view({-1});  // first this host's partial sum of this rank's block, then the whole sum
  const Wire wire(reduce_wire(op, input, reduce), dtype);
  const Pieces pieces(n, input.element_size());
  std::vector<std::vector<at::Tensor>> landings(pieces.count);  // where each piece's incoming bytes land
  // to_host[i]: this host's partial sums of local rank k's block of the i-th other host; from_host[i]: that host's
  // of this rank's block.
  at::Tensor send = at::empty({(hosts - 1) * n}, input.options());
  at::Tensor received = at::empty({(hosts - 1) * n}, input.options());
  std::vector<at::Tensor> to_host = send.chunk(hosts - 1), from_host = received.chunk(hosts - 1);
  InFlight rail{nullptr, std::vector<c10::intrusive_ptr<c10d::Work>>(pieces.count)};
  // Piece q of every block: summed in the host (the other hosts' first, so they go on the link at once), exchanged,
  // then summed over the hosts in host order once it is in, while later pieces are summed in the host. Piece q of
  // `output` is written only once the in-host step has read piece q of every input block (`output` may be this
  // rank's own block of `input`).
  auto scatter_piece = [&](int64_t q) {
    const size_t count = static_cast<size_t>(pieces.size(q));
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h == host_) continue;
      local_->reduce_scatter_strided(pieces.of(host_run(flat, h, n), q).data_ptr(), static_cast<size_t>(n),
                                     pieces.of(to_host[peer++], q).data_ptr(), count, dtype, reduce, in_host(op));
    }
    if (q == 0) rail.backend = inter_host_for(op);  // (a leader: after the fingerprint, which ran meanwhile)
    std::vector<at::Tensor> to_peer;
    for (int i = 0; i < hosts - 1; ++i) {
      to_peer.push_back(wire.outgoing(pieces.of(to_host[i], q)));
      landings[q].push_back(wire.landing(pieces.of(from_host[i], q)));
    }
    rail.works[q] = start_exchange(op, *rail.backend, to_peer, landings[q], static_cast<int>(q));
    local_->reduce_scatter_strided(pieces.of(host_run(flat, host_, n), q).data_ptr(), static_cast<size_t>(n),
                                   pieces.of(out, q).data_ptr(), count, dtype, reduce, in_host(op));
  };
  auto sum_piece = [&](int64_t q) {
    wait_inner(op, "the inter-host reduce-scatter (gloo on the rails)", rail.backend, rail.works[q]);
    std::vector<const void*> sums;
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h != host_) wire.arrived(landings[q][peer], pieces.of(from_host[peer], q));
      sums.push_back(pieces.of(h == host_ ? out : from_host[peer++], q).data_ptr());
    }
    landings[q].clear();
    core::reduce_into(pieces.of(out, q).data_ptr(), sums.data(), hosts, static_cast<size_t>(pieces.size(q)), dtype,
                      reduce);
  };
  for (int64_t q = 0; q <= pieces.count; ++q) {
    if (q < pieces.count) scatter_piece(q);
    if (q >= 1) sum_piece(q - 1);
  }
}

void HierarchicalEngine::gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  guarded(op, std::nullopt, [&] {
    std::vector<at::Tensor> inputs{as_bytes(input)};
    std::vector<std::vector<at::Tensor>> outputs;
    if (rank_ == root) outputs.push_back(as_bytes(output).chunk(size_));
    c10d::GatherOptions options;
    options.rootRank = root;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "gather (gloo over all ranks)", all_ranks, all_ranks->gather(outputs, inputs, options));
  });
}

void HierarchicalEngine::scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  guarded(op, std::nullopt, [&] {
    std::vector<at::Tensor> outputs{as_bytes(output)};
    std::vector<std::vector<at::Tensor>> inputs;
    if (rank_ == root) inputs.push_back(as_bytes(input).chunk(size_));
    c10d::ScatterOptions options;
    options.rootRank = root;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "scatter (gloo over all ranks)", all_ranks, all_ranks->scatter(outputs, inputs, options));
  });
}

void HierarchicalEngine::alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                                  at::Tensor& output, const std::vector<size_t>& recv_counts) {
  guarded(op, std::nullopt, [&] {
    const int64_t elem = static_cast<int64_t>(input.element_size());
    std::vector<int64_t> send_bytes, recv_bytes;
    for (size_t count : send_counts) send_bytes.push_back(static_cast<int64_t>(count) * elem);
    for (size_t count : recv_counts) recv_bytes.push_back(static_cast<int64_t>(count) * elem);
    at::Tensor in = as_bytes(input);
    at::Tensor out = as_bytes(output);
    c10d::AllToAllOptions options;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "all-to-all (gloo over all ranks)", all_ranks,
               all_ranks->alltoall_base(out, in, recv_bytes, send_bytes, options));
  });
}

}  // namespace shardkit::comm

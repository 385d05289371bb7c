#include "comm/local_p2p.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include <ATen/ATen.h>

namespace shardkit::comm {

namespace {

constexpr int64_t kMagic = 0x73686b7032707631;  // "shkp2pv1"
enum Descriptor { kMagicAt, kSenderAt, kPidAt, kAddressAt, kBytesAt, kSeqAt, kDescriptorSize };
// kRefused: the sizes differ; kFailed: the read failed otherwise. Both end the receive with an error.
enum Receipt : int64_t { kCopied = 0, kSendBytes = 1, kRefused = 2, kFailed = 3 };
// Staging buffers kept for reuse once their receipts are back (a pipeline sends the same shapes every step).
constexpr size_t kPoolBuffers = 8;

at::Tensor int64s(int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kLong)); }

std::vector<at::Tensor> one(const at::Tensor& t) { return {t}; }

// Reads `bytes` at `address` in process `pid` into `out`; returns 0, or the errno that stopped it.
int read_from(int32_t pid, uint64_t address, void* out, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<char*>(out) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};  // NOLINT(performance-no-int-to-ptr)
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

// A receive on the direct route: the protocol's receiver half runs in wait() (local_p2p.h).
class DirectRecvWork : public c10d::Work {
 public:
  DirectRecvWork(std::shared_ptr<LocalPointToPoint> owner, at::Tensor out, int expected_src, int tag,
                 std::string where)
      : c10d::Work(owner->options().rank, c10d::OpType::RECV, "shardkit:recv", std::vector<at::Tensor>{out}),
        owner_(std::move(owner)),
        out_(std::move(out)),
        descriptor_(int64s(kDescriptorSize)),
        expected_src_(expected_src),
        where_(std::move(where)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    auto gloo = owner_->gloo(where_);
    auto tensors = one(descriptor_);
    step_ = expected_src_ >= 0 ? gloo->recv(tensors, expected_src_, tag) : gloo->recvAnysource(tensors, tag);
    owner_->track(step_);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> once(run_mutex_);
    if (!ran_) {
      ran_ = true;
      std::exception_ptr error;
      try {
        run(timeout == kNoTimeout ? owner_->options().timeout : timeout);
      } catch (...) {
        error = std::current_exception();
      }
      finish(error);
      if (error) {
        future_->setError(error);
      } else {
        future_->markCompleted(c10::IValue(std::vector<at::Tensor>{out_}));
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(step_mutex_);
    aborted_ = true;
    if (step_) step_->abort();
  }

  int sourceRank() const override { return source_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  // Waits for `work` as this receive's current step (abort() ends it).
  void await(c10::intrusive_ptr<c10d::Work> work, std::chrono::milliseconds timeout) {
    {
      std::lock_guard<std::mutex> lock(step_mutex_);
      TORCH_CHECK(!aborted_, where_, "the receive was aborted");
      step_ = work;
      owner_->track(work);
    }
    TORCH_CHECK(work->wait(timeout), where_, "the receive was aborted");  // gloo's wait returns false once aborted
  }

  void run(std::chrono::milliseconds timeout) {
    await(step_, timeout);
    const int64_t* d = descriptor_.data_ptr<int64_t>();
    TORCH_CHECK(d[kMagicAt] == kMagic, where_, "a message of ", out_.nbytes(), " bytes arrived without shardkit's "
                "descriptor (was it sent with another backend, or a different SHARDKIT_P2P_DIRECT_BYTES?)");
    const auto& options = owner_->options();
    const int src = static_cast<int>(d[kSenderAt]);
    TORCH_CHECK(src >= 0 && src < static_cast<int>(options.on_this_host.size()) && src != options.rank, where_,
                "a descriptor names sender ", src, ", not a peer of this group");
    TORCH_CHECK(expected_src_ < 0 || src == expected_src_, where_, "expected a message from rank ",
                options.names.name(expected_src_), ", got one from rank ", options.names.name(src));
    source_ = src;
    const auto bytes = static_cast<size_t>(d[kBytesAt]);
    const int64_t seq = d[kSeqAt];
    int64_t status = kCopied;
    int read_error = 0;
    if (bytes != out_.nbytes()) {
      status = kRefused;
    } else if (!owner_->read_allowed() || static_cast<int32_t>(d[kPidAt]) != options.names.pid(src)) {
      status = kSendBytes;  // never read a process this group did not vouch for (another pid namespace)
    } else if (const int err = read_from(options.names.pid(src), static_cast<uint64_t>(d[kAddressAt]),
                                         out_.data_ptr(), bytes);
               err != 0) {
      if (err == EPERM || err == ENOSYS || err == EACCES) {
        status = kSendBytes;
        owner_->refuse_reads(std::string("process_vm_readv: ") + std::strerror(err));
      } else {
        status = kFailed;
        read_error = err;
      }
    } else {
      owner_->count_received(bytes);
    }
    auto receipt = int64s(2);
    receipt.data_ptr<int64_t>()[0] = status;
    receipt.data_ptr<int64_t>()[1] = seq;
    auto gloo = owner_->gloo(where_);
    auto receipt_tensors = one(receipt);
    await(gloo->send(receipt_tensors, src, LocalPointToPoint::receipt_tag(seq)), timeout);
    TORCH_CHECK(status != kRefused, where_, "recv of ", out_.nbytes(), " bytes from rank ", options.names.name(src),
                " met a send of ", bytes, " bytes: sender and receiver must agree on the tensor's size");
    TORCH_CHECK(status != kFailed, where_, "reading ", bytes, " bytes from rank ", options.names.name(src), " (pid ",
                d[kPidAt], ") failed: ", std::strerror(read_error));
    if (status == kSendBytes) {
      auto out_tensors = one(out_);
      await(gloo->recv(out_tensors, src, LocalPointToPoint::bytes_tag(seq)), timeout);
    }
  }

  std::shared_ptr<LocalPointToPoint> owner_;
  at::Tensor out_;
  at::Tensor descriptor_;
  const int expected_src_;
  const std::string where_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex run_mutex_;  // one waiter runs the protocol; others wait for it
  bool ran_ = false;
  std::mutex step_mutex_;
  c10::intrusive_ptr<c10d::Work> step_;  // the gloo Work the receive waits for now
  bool aborted_ = false;
  int source_ = -1;
};

}  // namespace

void TrackedWorks::add(const c10::intrusive_ptr<c10d::Work>& work) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (works_.size() >= 64) {  // forget the ended ones, so that the list stays as short as what waits
    std::vector<c10::weak_intrusive_ptr<c10d::Work>> live;
    for (const auto& weak : works_) {
      if (auto held = weak.lock(); held && !held->isCompleted()) live.push_back(weak);
    }
    works_ = std::move(live);
  }
  works_.emplace_back(work);
}

std::vector<c10::intrusive_ptr<c10d::Work>> TrackedWorks::take_waiting() {
  std::vector<c10::intrusive_ptr<c10d::Work>> waiting;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& weak : works_) {
    if (auto work = weak.lock(); work && !work->isCompleted()) waiting.push_back(std::move(work));
  }
  works_.clear();
  return waiting;
}

LocalPointToPoint::LocalPointToPoint(Options options, std::shared_ptr<InnerBackends> inner,
                                     std::shared_ptr<TrackedWorks> tracked)
    : options_(std::move(options)),
      inner_(std::move(inner)),
      tracked_(std::move(tracked)),
      read_allowed_(options_.direct_read),
      next_seq_(options_.on_this_host.size(), 0),
      reapers_(options_.on_this_host.size()) {}

LocalPointToPoint::~LocalPointToPoint() { shutdown(/*drain=*/false); }

void LocalPointToPoint::check_tag(int tag, const std::string& where) {
  TORCH_CHECK(tag >= 0 && tag < kControlTags, where, "tag ", tag, " is outside [0, ", kControlTags,
              "): shardkit keeps the tags above for its point-to-point protocol");
}

bool LocalPointToPoint::direct(const at::Tensor& tensor, int peer) const {
  return peer >= 0 && peer < static_cast<int>(options_.on_this_host.size()) && peer != options_.rank &&
         options_.on_this_host[peer] && options_.names.pid(peer) > 0 && tensor.device().is_cpu() &&
         tensor.layout() == at::kStrided && tensor.is_contiguous() && tensor.nbytes() >= options_.direct_bytes;
}

bool LocalPointToPoint::direct_from_any(const at::Tensor& tensor, const std::string& where) const {
  if (!tensor.device().is_cpu() || tensor.layout() != at::kStrided || !tensor.is_contiguous() ||
      tensor.nbytes() < options_.direct_bytes) {
    return false;
  }
  int local = 0, remote = 0;
  for (int r = 0; r < static_cast<int>(options_.on_this_host.size()); ++r) {
    if (r == options_.rank) continue;
    (options_.on_this_host[r] && options_.names.pid(r) > 0 ? local : remote) += 1;
  }
  TORCH_CHECK(local == 0 || remote == 0, where, "a receive from any source of ", tensor.nbytes(),
              " bytes (at least SHARDKIT_P2P_DIRECT_BYTES=", options_.direct_bytes, ") in a group with ranks on "
              "this host and on others is not supported: a sender on this host sends a descriptor, one elsewhere "
              "the bytes. Name the source (recv(tensor, src))");
  return remote == 0 && local > 0;
}

c10::intrusive_ptr<c10d::Work> LocalPointToPoint::send(const at::Tensor& tensor, int dst, int tag,
                                                       const std::string& where) {
  const size_t bytes = tensor.nbytes();
  at::Tensor staged = take_staging(bytes);
  std::memcpy(staged.data_ptr(), tensor.data_ptr(), bytes);
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    seq = next_seq_[dst]++;
  }
  at::Tensor descriptor = int64s(kDescriptorSize);
  int64_t* d = descriptor.data_ptr<int64_t>();
  d[kMagicAt] = kMagic;
  d[kSenderAt] = options_.rank;
  d[kPidAt] = ::getpid();
  d[kAddressAt] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(staged.data_ptr()));
  d[kBytesAt] = static_cast<int64_t>(bytes);
  d[kSeqAt] = seq;
  auto gloo = inner_->all_ranks(where);
  at::Tensor receipt = int64s(2);
  auto receipt_tensors = one(receipt);
  auto receipt_recv = gloo->recv(receipt_tensors, dst, receipt_tag(seq));  // posted before the descriptor leaves
  tracked_->add(receipt_recv);
  auto descriptor_tensors = one(descriptor);
  auto sent = gloo->send(descriptor_tensors, dst, tag);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Reaper& reaper = reapers_[dst];
    reaper.pending.push_back(Pending{seq, std::move(staged), std::move(receipt), std::move(receipt_recv), gloo});
    if (!reaper.thread.joinable() && !stopping_) reaper.thread = std::thread([this, dst] { reap(dst); });
  }
  wake_reapers_.notify_all();
  return sent;
}

c10::intrusive_ptr<c10d::Work> LocalPointToPoint::recv(const at::Tensor& tensor, int src, int tag,
                                                       const std::string& where) {
  return c10::make_intrusive<DirectRecvWork>(shared_from_this(), tensor, src, tag, where);
}

void LocalPointToPoint::reap(int dst) {
  Reaper& reaper = reapers_[dst];
  for (;;) {
    Pending next;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_reapers_.wait(lock, [&] { return stopping_ || !reaper.pending.empty(); });
      if (reaper.pending.empty()) return;  // stopping, nothing left
      next = std::move(reaper.pending.front());
      reaper.pending.pop_front();
      reaper.awaited = next.receipt_recv;
    }
    bool gave_up = false;
    try {
      gave_up = !next.receipt_recv->wait(options_.timeout);  // false: aborted
      if (!gave_up && next.receipt.data_ptr<int64_t>()[0] == kSendBytes) {
        auto staged = one(next.staged);
        auto sent = next.gloo->send(staged, dst, bytes_tag(next.seq));
        tracked_->add(sent);
        gave_up = !sent->wait(options_.timeout);
      }
    } catch (const std::exception&) {
      // The receiver failed, died, or the group ended: the receiver's receive reports it (or nobody waits).
      gave_up = true;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    reaper.awaited.reset();
    reaped_.notify_all();
    if (gave_up) {
      InnerBackends::abandon(next.gloo);  // an op given up on may still run on it (inner_backends.h)
    } else if (staging_pool_.size() < kPoolBuffers) {
      staging_pool_.push_back(std::move(next.staged));
    }
  }
}

at::Tensor LocalPointToPoint::take_staging(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = staging_pool_.begin(); it != staging_pool_.end(); ++it) {
      if (it->nbytes() == bytes) {
        at::Tensor found = std::move(*it);
        staging_pool_.erase(it);
        return found;
      }
    }
  }
  return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

void LocalPointToPoint::refuse_reads(const std::string& why) {
  if (read_allowed_.exchange(false)) {
    std::cerr << "shardkit (rank " << options_.names.name(options_.rank) << "): point-to-point messages between "
              << "ranks of one host go through gloo from now on: the kernel refuses to read a peer's memory (" << why
              << "; a ptrace policy or seccomp)" << std::endl;
  }
}

void LocalPointToPoint::shutdown(bool drain) {
  std::vector<c10::intrusive_ptr<c10d::Work>> to_abort;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (drain) {
      const auto idle = [this] {
        for (const Reaper& reaper : reapers_) {
          if (!reaper.pending.empty() || reaper.awaited) return false;
        }
        return true;
      };
      reaped_.wait_for(lock, options_.timeout, idle);
    }
    stopping_ = true;
    for (Reaper& reaper : reapers_) {
      if (reaper.awaited) to_abort.push_back(reaper.awaited);
      for (Pending& pending : reaper.pending) {
        to_abort.push_back(pending.receipt_recv);
        InnerBackends::abandon(pending.gloo);
      }
      reaper.pending.clear();
    }
  }
  for (auto& work : to_abort) work->abort();
  wake_reapers_.notify_all();
  for (Reaper& reaper : reapers_) {
    if (reaper.thread.joinable() && reaper.thread.get_id() != std::this_thread::get_id()) reaper.thread.join();
  }
}

}  // namespace shardkit::comm

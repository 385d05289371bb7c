#include "comm/local_p2p.h"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <system_error>

#include <ATen/ATen.h>

namespace shardkit::comm {

namespace {

constexpr int64_t kMagic = 0x73686b7032707631;  // "shkp2pv1"
enum Descriptor { kMagicAt, kSenderAt, kPidAt, kAddressAt, kBytesAt, kSeqAt, kDescriptorSize };
// kRefused: the sizes differ; kFailed: the receive failed otherwise. Both end the receive with an error.
enum Receipt : int64_t { kCopied = 0, kSendBytes = 1, kRefused = 2, kFailed = 3 };
// Staging buffers kept for reuse once their receipts are back (a pipeline sends the same shapes every step).
constexpr size_t kPoolBuffers = 8;
constexpr size_t kPoolBytes = size_t{256} << 20;

int receipt_tag(int64_t seq) { return LocalPointToPoint::kControlTags + 2 * static_cast<int>(seq % (1 << 28)); }
int bytes_tag(int64_t seq) { return receipt_tag(seq) + 1; }

at::Tensor int64s(int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kLong)); }

std::vector<at::Tensor> one(const at::Tensor& t) { return {t}; }

std::string error_text(int err) { return std::system_category().message(err); }

// Reads `bytes` at `address` in process `pid` into `out`; returns 0, or the errno that stopped it.
int read_from(int32_t pid, uint64_t address, void* out, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<char*>(out) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};  // NOLINT(performance-no-int-to-ptr)
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);  // a read may stop at a page boundary: go on from there
  }
  return 0;
}

// A staging buffer of `bytes`, backed by transparent huge pages where the kernel has them: process_vm_readv pins
// the sender's pages one by one, and with 4 KiB pages (what torch's allocator gives) a 64 MiB read ran at a third
// of memcpy's speed here (9-13 ms against 3.7 ms with 2 MiB pages).
at::Tensor huge_page_buffer(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* data = nullptr;
  TORCH_CHECK(posix_memalign(&data, kHuge, rounded) == 0, "shardkit: could not allocate a point-to-point staging "
              "buffer of ", rounded, " bytes");
  madvise(data, rounded, MADV_HUGEPAGE);  // advice: where THP is off, the buffer simply has small pages
  return at::from_blob(data, {static_cast<int64_t>(bytes)}, [](void* p) { std::free(p); },
                       at::TensorOptions().dtype(at::kByte));
}

// Staging buffers given up on (their receipt never came back): a receiver may still read them, so they are kept for
// the life of the process (leaked on purpose, like InnerBackends::abandon's backends).
void bury(at::Tensor staged) {
  static std::mutex mutex;
  static auto* graveyard = new std::vector<at::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  graveyard->push_back(std::move(staged));
}

}  // namespace

// --- TrackedWorks --------------------------------------------------------------------------------------------------

void TrackedWorks::add(const c10::intrusive_ptr<c10d::Work>& work) {
  std::vector<c10::intrusive_ptr<c10d::Work>> released;  // dropped after the lock: a Work's end may run anything
  std::lock_guard<std::mutex> lock(mutex_);
  if (works_.size() >= 64) {  // forget the ended ones, so that the list stays as short as what waits
    std::vector<c10::weak_intrusive_ptr<c10d::Work>> live;
    for (const auto& weak : works_) {
      auto held = weak.lock();
      if (held && !held->isCompleted()) live.push_back(weak);
      released.push_back(std::move(held));
    }
    works_ = std::move(live);
  }
  works_.emplace_back(work);
}

std::vector<c10::intrusive_ptr<c10d::Work>> TrackedWorks::take_waiting() {
  std::vector<c10::intrusive_ptr<c10d::Work>> waiting, released;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& weak : works_) {
      auto work = weak.lock();
      (work && !work->isCompleted() ? waiting : released).push_back(std::move(work));
    }
    works_.clear();
  }
  return waiting;
}

// --- what the message threads share ---------------------------------------------------------------------------------

struct LocalPointToPoint::Shared {
  Options options;
  std::shared_ptr<InnerBackends> inner;
  std::shared_ptr<TrackedWorks> tracked;
  std::atomic<bool> read_allowed;
  std::atomic<uint64_t> received{0};
  std::mutex pool_mutex;
  std::vector<at::Tensor> pool;  // staging buffers whose receipts came back

  Shared(Options o, std::shared_ptr<InnerBackends> i, std::shared_ptr<TrackedWorks> t)
      : options(std::move(o)), inner(std::move(i)), tracked(std::move(t)), read_allowed(options.direct_read) {}

  at::Tensor take_staging(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(pool_mutex);
      for (auto it = pool.begin(); it != pool.end(); ++it) {
        if (it->nbytes() == bytes) {
          at::Tensor found = std::move(*it);
          pool.erase(it);
          return found;
        }
      }
    }
    return huge_page_buffer(bytes);
  }

  void give_back(at::Tensor staged) {
    std::lock_guard<std::mutex> lock(pool_mutex);
    size_t held = 0;
    for (const auto& buffer : pool) held += buffer.nbytes();
    if (pool.size() < kPoolBuffers && held + staged.nbytes() <= kPoolBytes) pool.push_back(std::move(staged));
  }

  // The kernel refused a read: every later message asks for its bytes over gloo (logged once).
  void refuse_reads(const std::string& why) {
    if (read_allowed.exchange(false)) {
      std::cerr << "shardkit (rank " << options.names.name(options.rank) << "): point-to-point messages between "
                << "ranks of one host carry their bytes over gloo from now on: the kernel refuses to read a peer's "
                << "memory (" << why << "; a ptrace policy or seccomp)" << std::endl;
    }
  }
};

// --- one message ----------------------------------------------------------------------------------------------------

struct LocalPointToPoint::Transfer {
  Transfer(std::string w, bool s) : where(std::move(w)), is_send(s) {}

  const std::string where;
  const bool is_send;
  std::mutex mutex;  // guards below
  std::condition_variable changed;
  bool handed_over = false;  // the caller's Work may complete (a send: its descriptor is delivered)
  bool finished = false;     // the message's thread has nothing left to do
  std::exception_ptr error;  // why the caller's Work failed
  int source = -1;           // a receive's sender
  c10::intrusive_ptr<c10d::Work> step;  // the gloo Work the thread waits for now
  bool aborted = false;

  // Waits for `work` as the message's current step (abort() ends it).
  void await(const c10::intrusive_ptr<c10d::Work>& work, Shared& shared) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      TORCH_CHECK(!aborted, where, "the point-to-point op was aborted");
      step = work;
    }
    shared.tracked->add(work);
    const bool ended = work->wait(shared.options.timeout);  // false: aborted (gloo)
    std::lock_guard<std::mutex> lock(mutex);
    step.reset();
    TORCH_CHECK(ended && !aborted, where, "the point-to-point op was aborted");
  }

  void abort() {
    c10::intrusive_ptr<c10d::Work> current;
    {
      std::lock_guard<std::mutex> lock(mutex);
      aborted = true;
      current = step;
    }
    if (current) current->abort();
  }

  void hand_over(std::exception_ptr failure) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!handed_over) {
      handed_over = true;
      error = std::move(failure);
    }
    changed.notify_all();
  }

  void finish() {
    std::lock_guard<std::mutex> lock(mutex);
    finished = true;
    changed.notify_all();
  }
};

namespace {

// The caller's Work for a message on the direct route: it waits for the message's thread.
class DirectWork : public c10d::Work {
 public:
  DirectWork(std::shared_ptr<LocalPointToPoint::Transfer> transfer, int rank, c10d::OpType type,
             std::chrono::milliseconds default_timeout, const at::Tensor& tensor)
      : c10d::Work(rank, type, nullptr, std::vector<at::Tensor>{tensor}),
        transfer_(std::move(transfer)),
        default_timeout_(default_timeout) {}

  bool wait(std::chrono::milliseconds timeout) override {
    const auto limit = timeout == kNoTimeout ? default_timeout_ : timeout;
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lock(transfer_->mutex);
      if (!transfer_->changed.wait_for(lock, limit, [&] { return transfer_->handed_over; })) {
        lock.unlock();
        TORCH_CHECK(false, transfer_->where, "timed out after ", limit.count(), " ms waiting for the ",
                    transfer_->is_send ? "send to be handed over" : "message to arrive");
      }
      error = transfer_->error;
    }
    finish(error);  // Work's own state, for callers that ask it (exception(), isSuccess()); idempotent
    if (error) std::rethrow_exception(error);
    return true;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(transfer_->mutex);
    return transfer_->handed_over;
  }

  void abort() override { transfer_->abort(); }

  int sourceRank() const override {
    std::lock_guard<std::mutex> lock(transfer_->mutex);
    return transfer_->source;
  }

 private:
  std::shared_ptr<LocalPointToPoint::Transfer> transfer_;
  const std::chrono::milliseconds default_timeout_;
};

}  // namespace

// --- the route ------------------------------------------------------------------------------------------------------

LocalPointToPoint::LocalPointToPoint(Options options, std::shared_ptr<InnerBackends> inner,
                                     std::shared_ptr<TrackedWorks> tracked)
    : shared_(std::make_shared<Shared>(std::move(options), std::move(inner), std::move(tracked))),
      next_seq_(shared_->options.on_this_host.size(), 0) {}

LocalPointToPoint::~LocalPointToPoint() { shutdown(/*drain=*/false); }

void LocalPointToPoint::check_tag(int tag, const std::string& where) {
  TORCH_CHECK(tag >= 0 && tag < kControlTags, where, "tag ", tag, " is outside [0, ", kControlTags,
              "): shardkit keeps the tags above for its point-to-point protocol");
}

bool LocalPointToPoint::direct(const at::Tensor& tensor, int peer) const {
  const Options& o = shared_->options;
  return peer >= 0 && peer < static_cast<int>(o.on_this_host.size()) && peer != o.rank && o.on_this_host[peer] &&
         o.names.pid(peer) > 0 && tensor.device().is_cpu() && tensor.layout() == at::kStrided &&
         tensor.is_contiguous() && tensor.nbytes() >= o.direct_bytes;
}

bool LocalPointToPoint::direct_from_any(const at::Tensor& tensor, const std::string& where) const {
  const Options& o = shared_->options;
  if (!tensor.device().is_cpu() || tensor.layout() != at::kStrided || !tensor.is_contiguous() ||
      tensor.nbytes() < o.direct_bytes) {
    return false;
  }
  int local = 0, remote = 0;
  for (int r = 0; r < static_cast<int>(o.on_this_host.size()); ++r) {
    if (r == o.rank) continue;
    (o.on_this_host[r] && o.names.pid(r) > 0 ? local : remote) += 1;
  }
  TORCH_CHECK(local == 0 || remote == 0, where, "a receive from any source of ", tensor.nbytes(),
              " bytes (at least SHARDKIT_P2P_DIRECT_BYTES=", o.direct_bytes, ") in a group with ranks on "
              "this host and on others is not supported: a sender on this host sends a descriptor, one elsewhere "
              "the bytes. Name the source (recv(tensor, src))");
  return remote == 0 && local > 0;
}

uint64_t LocalPointToPoint::direct_bytes_received() const { return shared_->received.load(); }

void LocalPointToPoint::start(const std::shared_ptr<Transfer>& transfer, std::function<void()> body) {
  std::vector<std::thread> ended;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopped_, transfer->where, "the process group was shut down");
    for (auto it = threads_.begin(); it != threads_.end();) {
      bool done = false;
      {
        std::lock_guard<std::mutex> transfer_lock(it->first->mutex);
        done = it->first->finished;
      }
      if (done) {
        ended.push_back(std::move(it->second));
        it = threads_.erase(it);
      } else {
        ++it;
      }
    }
    threads_.emplace_back(transfer, std::thread(std::move(body)));
  }
  for (auto& thread : ended) thread.join();  // each has returned, or is returning, from its body
}

c10::intrusive_ptr<c10d::Work> LocalPointToPoint::send(const at::Tensor& tensor, int dst, int tag,
                                                       const std::string& where) {
  const Options& o = shared_->options;
  const size_t bytes = tensor.nbytes();
  at::Tensor staged = shared_->take_staging(bytes);
  std::memcpy(staged.data_ptr(), tensor.data_ptr(), bytes);
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    seq = next_seq_[dst]++;
  }
  at::Tensor descriptor = int64s(kDescriptorSize);
  int64_t* d = descriptor.data_ptr<int64_t>();
  d[kMagicAt] = kMagic;
  d[kSenderAt] = o.rank;
  d[kPidAt] = ::getpid();
  d[kAddressAt] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(staged.data_ptr()));
  d[kBytesAt] = static_cast<int64_t>(bytes);
  d[kSeqAt] = seq;
  auto transfer = std::make_shared<Transfer>(where, /*is_send=*/true);
  auto gloo = shared_->inner->all_ranks(where);  // held for the whole message (inner_backends.h)
  at::Tensor receipt = int64s(2);
  // Posted here, on the caller's thread: gloo orders a pair's messages (per tag) by these calls.
  auto receipt_tensors = one(receipt);
  auto receipt_recv = gloo->recv(receipt_tensors, dst, receipt_tag(seq));
  auto descriptor_tensors = one(descriptor);
  auto sent = gloo->send(descriptor_tensors, dst, tag);
  start(transfer, [shared = shared_, transfer, gloo, staged, descriptor, receipt, receipt_recv, sent, dst, seq] {
    try {
      transfer->await(sent, *shared);
      transfer->hand_over(nullptr);  // the message is handed over; the staged bytes wait for the receiver
      transfer->await(receipt_recv, *shared);
      if (receipt.data_ptr<int64_t>()[0] == kSendBytes) {
        auto staged_tensors = one(staged);
        transfer->await(gloo->send(staged_tensors, dst, bytes_tag(seq)), *shared);
      }
      shared->give_back(staged);
    } catch (...) {
      transfer->hand_over(std::current_exception());  // nothing where it was handed over already
      bury(staged);                                    // the receiver may still read it
      InnerBackends::abandon(gloo);                    // an op given up on may still run on it
    }
    transfer->finish();
  });
  return c10::make_intrusive<DirectWork>(transfer, o.rank, c10d::OpType::SEND, o.timeout, tensor);
}

c10::intrusive_ptr<c10d::Work> LocalPointToPoint::recv(const at::Tensor& tensor, int src, int tag,
                                                       const std::string& where) {
  const Options& o = shared_->options;
  auto transfer = std::make_shared<Transfer>(where, /*is_send=*/false);
  auto gloo = shared_->inner->all_ranks(where);
  at::Tensor descriptor = int64s(kDescriptorSize);
  auto descriptor_tensors = one(descriptor);
  auto descriptor_recv = src >= 0 ? gloo->recv(descriptor_tensors, src, tag) : gloo->recvAnysource(descriptor_tensors, tag);
  at::Tensor out = tensor;
  start(transfer, [shared = shared_, transfer, gloo, descriptor, descriptor_recv, out, src] {
    const Options& options = shared->options;
    const std::string& where = transfer->where;
    int sender = -1;
    int64_t seq = -1;
    bool receipt_sent = false;
    try {
      transfer->await(descriptor_recv, *shared);
      const int64_t* d = descriptor.data_ptr<int64_t>();
      TORCH_CHECK(d[kMagicAt] == kMagic, where, "a message of ", out.nbytes(), " bytes arrived without shardkit's "
                  "descriptor (was it sent with another backend, or with a different SHARDKIT_P2P_DIRECT_BYTES?)");
      sender = static_cast<int>(d[kSenderAt]);
      const int delivered_by = src >= 0 ? src : descriptor_recv->sourceRank();
      TORCH_CHECK(sender == delivered_by && sender != options.rank && d[kSeqAt] >= 0, where, "a descriptor from rank ",
                  options.names.name(delivered_by), " names sender ", sender, " and sequence ", d[kSeqAt]);
      seq = d[kSeqAt];
      {
        std::lock_guard<std::mutex> lock(transfer->mutex);
        transfer->source = sender;
      }
      const auto bytes = static_cast<size_t>(d[kBytesAt]);
      int64_t status = kCopied;
      int read_error = 0;
      if (bytes != out.nbytes()) {
        status = kRefused;
      } else if (!shared->read_allowed.load() || static_cast<int32_t>(d[kPidAt]) != options.names.pid(sender)) {
        status = kSendBytes;  // never read a process the group did not vouch for (another pid namespace)
      } else if (const int err = read_from(options.names.pid(sender), static_cast<uint64_t>(d[kAddressAt]),
                                           out.data_ptr(), bytes);
                 err == EPERM || err == ENOSYS || err == EACCES) {
        status = kSendBytes;
        shared->refuse_reads("process_vm_readv: " + error_text(err));
      } else if (err != 0) {
        status = kFailed;
        read_error = err;
      } else {
        shared->received += bytes;
      }
      at::Tensor receipt = int64s(2);
      receipt.data_ptr<int64_t>()[0] = status;
      receipt.data_ptr<int64_t>()[1] = seq;
      auto receipt_tensors = one(receipt);
      receipt_sent = true;  // from here the sender hears of this message, whatever happens next
      transfer->await(gloo->send(receipt_tensors, sender, receipt_tag(seq)), *shared);
      TORCH_CHECK(status != kRefused, where, "recv of ", out.nbytes(), " bytes from rank ",
                  options.names.name(sender), " met a send of ", bytes,
                  " bytes: sender and receiver must agree on the tensor's size");
      TORCH_CHECK(status != kFailed, where, "reading ", bytes, " bytes from rank ", options.names.name(sender),
                  " (pid ", d[kPidAt], ") failed: ", error_text(read_error));
      if (status == kSendBytes) {
        auto out_tensors = one(out);
        transfer->await(gloo->recv(out_tensors, sender, bytes_tag(seq)), *shared);
      }
      transfer->hand_over(nullptr);
    } catch (...) {
      const auto error = std::current_exception();
      if (sender >= 0 && seq >= 0 && !receipt_sent) {  // the sender waits for a receipt: tell it
        try {
          at::Tensor receipt = int64s(2);
          receipt.data_ptr<int64_t>()[0] = kFailed;
          receipt.data_ptr<int64_t>()[1] = seq;
          auto receipt_tensors = one(receipt);
          transfer->await(gloo->send(receipt_tensors, sender, receipt_tag(seq)), *shared);
        } catch (...) {
        }
      }
      transfer->hand_over(error);
      InnerBackends::abandon(gloo);  // an op given up on may still run on it
    }
    transfer->finish();
  });
  return c10::make_intrusive<DirectWork>(transfer, o.rank, src >= 0 ? c10d::OpType::RECV : c10d::OpType::RECVANYSOURCE,
                                         o.timeout, tensor);
}

void LocalPointToPoint::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [transfer, thread] : threads_) transfer->abort();
}

void LocalPointToPoint::shutdown(bool drain) {
  std::vector<std::pair<std::shared_ptr<Transfer>, std::thread>> taken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    taken = std::move(threads_);
    threads_.clear();
  }
  if (drain) {  // sends handed over wait for their receipts: the receivers read the staged bytes meanwhile
    const auto deadline = std::chrono::steady_clock::now() + shared_->options.timeout;
    for (auto& [transfer, thread] : taken) {
      std::unique_lock<std::mutex> lock(transfer->mutex);
      if (transfer->is_send && transfer->handed_over) {
        transfer->changed.wait_until(lock, deadline, [&] { return transfer->finished; });
      }
    }
  }
  for (auto& [transfer, thread] : taken) transfer->abort();
  for (auto& [transfer, thread] : taken) {
    if (thread.joinable()) thread.join();
  }
}

}  // namespace shardkit::comm

#include "comm/nccl/cuda_watchdog.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <stdexcept>
#include <utility>
#include <vector>

namespace shardkit::comm {

namespace {

// How long to wait between polls of the oldest op: short at first (small ops end within microseconds, and
// their memory should come back soon), then coarser, so that a long op costs little CPU. Reset whenever the
// oldest op changes.
std::chrono::microseconds poll_interval(int polls) {
  if (polls < 50) return std::chrono::microseconds(20);
  if (polls < 1000) return std::chrono::microseconds(200);
  return std::chrono::microseconds(1000);
}

// After an abort, how long the references of the failed ops are kept waiting for their (aborted) kernels to
// leave the device; past it they are kept for good rather than freed under a kernel that may still run.
constexpr std::chrono::seconds kDrainAfterAbort{10};

std::string missed_deadline(const OpContext& op) {
  return "the collective did not complete on the device within " + std::to_string(op.timeout.count()) +
         " ms (a rank did not join it, or a GPU stalled)";
}

void keep_for_good(std::shared_ptr<void> keep_alive) {
  static std::mutex kept_mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never freed, on purpose
  std::lock_guard<std::mutex> lock(kept_mutex);
  kept->push_back(std::move(keep_alive));
}

}  // namespace

CudaWatchdog::CudaWatchdog(std::function<std::string()> health, std::function<void(const std::string&)> abort)
    : health_(std::move(health)), abort_(std::move(abort)) {}

CudaWatchdog::~CudaWatchdog() { stop(); }

void CudaWatchdog::watch(const OpContext& op, const c10::Device& device, c10::intrusive_ptr<ShardkitWork> work,
                         std::shared_ptr<void> keep_alive) {
  add({op, std::chrono::steady_clock::now() + op.timeout, std::move(work), nullptr, std::move(keep_alive)}, device);
}

void CudaWatchdog::hold(const OpContext& op, const c10::Stream& stream, std::shared_ptr<void> keep_alive) {
  auto after = std::make_shared<c10::Event>(stream.device_type());
  after->record(stream);
  add({op, std::chrono::steady_clock::now() + op.timeout, nullptr, std::move(after), std::move(keep_alive)},
      stream.device());
}

void CudaWatchdog::add(InFlight item, c10::Device device) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      in_flight_.push_back(std::move(item));
      if (!thread_.joinable()) thread_ = std::thread([this, device] { run(device); });
      changed_.notify_one();
      return;
    }
  }
  // Only after stop() (the worker stopped first, so not today): follow it here.
  const c10::cuda::CUDAGuard on_device(device);
  follow_here(std::move(item));
}

void CudaWatchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  changed_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void CudaWatchdog::run(c10::Device device) {
  c10::cuda::set_device(device.index());  // queries and event destruction on this GPU, not on GPU 0
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stopping_ || !in_flight_.empty(); });
      if (in_flight_.empty()) return;  // stopping, and nothing is in flight
    }
    int polls = 0;
    for (Pass pass = poll(); pass.left > 0; pass = poll()) {
      polls = pass.progressed ? 0 : polls + 1;
      std::this_thread::sleep_for(poll_interval(polls));
    }
  }
}

CudaWatchdog::Pass CudaWatchdog::poll() {
  Pass pass;
  std::string problem;
  try {
    // Only this thread removes ops, and a deque's push_back keeps references to its elements valid, so the
    // oldest op can be read without the lock while the worker appends.
    for (;;) {
      InFlight* oldest = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (in_flight_.empty()) return pass;
        oldest = &in_flight_.front();
      }
      if (!oldest->done()) break;
      // Done, but cut short by an abort? The failure is recorded before NCCL aborts, so this tells.
      problem = health_();
      if (!problem.empty()) break;
      InFlight done;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        done = std::move(in_flight_.front());
        in_flight_.pop_front();
      }
      if (done.work) done.work->device_finished();
      pass.progressed = true;
      // `done` goes here, outside the lock: its tensors may now be freed, the device has finished with them.
    }
    if (problem.empty()) problem = health_();
    if (problem.empty()) {
      // A late op anywhere means the oldest has not finished either (one stream runs them in order): the
      // oldest is the one named.
      const auto now = std::chrono::steady_clock::now();
      std::lock_guard<std::mutex> lock(mutex_);
      for (const InFlight& item : in_flight_) {
        if (now > item.deadline) {
          problem = missed_deadline(item.op);
          break;
        }
      }
    }
  } catch (const std::exception& error) {
    problem = std::string("CUDA error while following the collective: ") + error.what();
  }
  std::deque<InFlight> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (problem.empty()) {
      pass.left = in_flight_.size();
      return pass;
    }
    failed.swap(in_flight_);
  }
  fail_all(std::move(failed), problem);
  return pass;  // nothing is left in flight
}

void CudaWatchdog::fail_all(std::deque<InFlight> failed, const std::string& reason) {
  if (failed.empty()) return;
  // The oldest op in flight carries the reason: the ones after it ran (or would run) behind it on one stream.
  const OpContext& first = failed.front().op;
  const std::string message = first.where() + reason + "; the NCCL communicator was aborted";
  for (InFlight& item : failed) {
    if (!item.work) continue;
    const std::string text = &item == &failed.front() ? message
                                                       : item.op.where() + "an earlier collective failed (" + message + ")";
    item.work->device_failed(std::make_exception_ptr(std::runtime_error(text)));
  }
  TORCH_WARN(message);  // now: a caller that waited on the op's stream only learns of it from here or its next op
  abort_(std::string(first.op) + " #" + std::to_string(first.seq) + ": " + reason);
  // The aborted kernels leave the device; only then may the ops' memory be reused.
  const auto until = std::chrono::steady_clock::now() + kDrainAfterAbort;
  for (InFlight& item : failed) {
    bool left = false;
    try {
      while (!(left = item.done()) && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } catch (const std::exception&) {
      left = false;  // a CUDA error: whether the kernels left is unknown
    }
    if (!left) {
      keep_for_good(std::move(item.keep_alive));
      TORCH_WARN("shardkit: the aborted ", item.op.op, " #", item.op.seq, " may still be on the device; its tensors "
                 "are kept alive for the rest of the process");
    }
  }
}

void CudaWatchdog::follow_here(InFlight item) {
  for (int polls = 0;; ++polls) {
    std::string problem;
    try {
      const bool done = item.done();
      problem = health_();
      if (done && problem.empty()) {
        if (item.work) item.work->device_finished();
        return;
      }
      if (problem.empty() && std::chrono::steady_clock::now() > item.deadline) problem = missed_deadline(item.op);
    } catch (const std::exception& error) {
      problem = std::string("CUDA error while following the collective: ") + error.what();
    }
    if (!problem.empty()) {
      std::deque<InFlight> failed;
      failed.push_back(std::move(item));
      fail_all(std::move(failed), problem);
      return;
    }
    std::this_thread::sleep_for(poll_interval(polls));
  }
}

}  // namespace shardkit::comm

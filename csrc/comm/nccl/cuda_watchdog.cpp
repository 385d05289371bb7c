#include "comm/nccl/cuda_watchdog.h"

#include <c10/util/Exception.h>

#include <stdexcept>
#include <utility>
#include <vector>

namespace shardkit::comm {

namespace {

// How long to wait between polls of an op in flight: short at first (small ops end within microseconds, and
// their memory should come back soon), then coarser, so that a long op costs little CPU.
std::chrono::microseconds poll_interval(int polls) {
  if (polls < 50) return std::chrono::microseconds(20);
  if (polls < 1000) return std::chrono::microseconds(200);
  return std::chrono::microseconds(1000);
}

// After an abort, how long the references of the ops in flight are kept waiting for their (aborted) kernels
// to leave the device; past it they are kept for good rather than freed under a kernel that may still run.
constexpr std::chrono::seconds kDrainAfterAbort{10};

}  // namespace

CudaWatchdog::CudaWatchdog(std::function<std::string()> health, std::function<void(const std::string&)> abort)
    : health_(std::move(health)), abort_(std::move(abort)) {}

CudaWatchdog::~CudaWatchdog() { stop(); }

void CudaWatchdog::watch(const OpContext& op, c10::intrusive_ptr<ShardkitWork> work,
                         std::shared_ptr<void> keep_alive) {
  InFlight item{op, std::chrono::steady_clock::now() + op.timeout, std::move(work), std::move(keep_alive)};
  bool follow_here = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.push_back(std::move(item));
    if (stopped_) {
      follow_here = true;
    } else if (!thread_.joinable()) {
      thread_ = std::thread([this] { run(); });
    }
  }
  if (follow_here) {
    for (int polls = 0; poll(); ++polls) std::this_thread::sleep_for(poll_interval(polls));
    return;
  }
  changed_.notify_one();
}

void CudaWatchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopping_ = true;
  }
  changed_.notify_one();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_ = true;
}

void CudaWatchdog::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stopping_ || !in_flight_.empty(); });
      if (in_flight_.empty()) return;  // stopping, and nothing is in flight
    }
    for (int polls = 0; poll(); ++polls) std::this_thread::sleep_for(poll_interval(polls));
  }
}

bool CudaWatchdog::poll() {
  // Only this thread removes ops, and a deque's push_back keeps references to its elements valid, so the
  // oldest op can be read without the lock while the worker appends.
  for (;;) {
    ShardkitWork* oldest = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (in_flight_.empty()) return false;
      oldest = in_flight_.front().work.get();
    }
    if (!oldest->device_done()) break;
    InFlight done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    done.work->device_finished();
    // `done` goes here, outside the lock: its tensors may now be freed, the device has finished with them.
  }
  std::string reason = health_();
  InFlight* culprit = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (reason.empty()) {
      const auto now = std::chrono::steady_clock::now();
      for (InFlight& item : in_flight_) {
        if (now > item.deadline) {
          reason = "the collective did not complete on the device within " + std::to_string(item.op.timeout.count()) +
                   " ms (a rank did not join it, or a GPU stalled)";
          culprit = &item;
          break;
        }
      }
    } else {
      culprit = &in_flight_.front();
    }
  }
  if (culprit == nullptr) return true;
  fail_all(*culprit, reason);
  return false;
}

void CudaWatchdog::fail_all(const InFlight& culprit, const std::string& reason) {
  const std::string message = culprit.op.where() + reason + "; the NCCL communicator was aborted";
  abort_(std::string(culprit.op.op) + " #" + std::to_string(culprit.op.seq) + ": " + reason);
  TORCH_WARN(message);  // now: a caller that waited on the op's stream only learns of it from here or its next op
  std::deque<InFlight> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failed.swap(in_flight_);
  }
  for (InFlight& item : failed) {
    const std::string text = &item == &culprit || item.op.seq == culprit.op.seq
                                 ? message
                                 : item.op.where() + "an earlier collective failed (" + message + ")";
    item.work->device_failed(std::make_exception_ptr(std::runtime_error(text)));
  }
  // The aborted kernels leave the device; only then may the ops' memory be reused.
  const auto until = std::chrono::steady_clock::now() + kDrainAfterAbort;
  for (InFlight& item : failed) {
    while (!item.work->device_done() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!item.work->device_done()) {
      static std::mutex kept_mutex;
      static std::vector<std::shared_ptr<void>>* kept = new std::vector<std::shared_ptr<void>>();  // never freed
      std::lock_guard<std::mutex> lock(kept_mutex);
      kept->push_back(std::move(item.keep_alive));
      TORCH_WARN("shardkit: the aborted ", item.op.op, " #", item.op.seq, " is still on the device after ",
                 kDrainAfterAbort.count(), " s; its tensors are kept alive for the rest of the process");
    }
  }
}

}  // namespace shardkit::comm

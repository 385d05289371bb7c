// CudaWatchdog: the thread that follows a group's CUDA collectives from issue to their end on the device
// (CUDA builds only).
//
// CudaRoute queues an op on the communication stream and hands it here (watch()); the op's Work has then
// completed as "issued" (work_queue.h), and the caller goes on without waiting. This thread polls the ops in
// flight, oldest first:
//   - done on the device: the Work is told (device_finished()) and the references that kept the op's tensors
//     alive are dropped here, so their memory is reused only after the op has read and written it, without
//     recordStream (memory use stays deterministic);
//   - NCCL reported an asynchronous error (`health()` says why), or the op passed its deadline: the
//     communicator is aborted (`abort(reason)`, from this thread: a non-blocking communicator allows it, and
//     the aborted kernels exit, so nothing waits on the stream for ever) and this op and every later one in
//     flight fail with a message naming the op, its number and the rank. Later collectives of the group
//     fail at once with that reason (NcclEngine keeps it), and the message is also written to the log at
//     once, since a caller may have no Work left to wait on.
// stop() waits for the ops in flight (each has its deadline) and joins the thread.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/engine.h"
#include "comm/work_queue.h"

namespace shardkit::comm {

class CudaWatchdog {
 public:
  // `health`: "" while the communicator is well, else why not (called on this thread between polls).
  // `abort`: aborts the communicator, recording `reason` as the group's failure (idempotent).
  CudaWatchdog(std::function<std::string()> health, std::function<void(const std::string&)> abort);
  ~CudaWatchdog();  // stop()
  CudaWatchdog(const CudaWatchdog&) = delete;
  CudaWatchdog& operator=(const CudaWatchdog&) = delete;

  // The worker, after `work->issued_on(stream)`: follow the op until it ends on the device. `keep_alive` holds
  // the op's tensors (and whatever else it used) until then.
  void watch(const OpContext& op, c10::intrusive_ptr<ShardkitWork> work, std::shared_ptr<void> keep_alive);
  // Waits until nothing is in flight, then joins the thread (idempotent). Ops watched afterwards are followed
  // on the caller's thread, until they end.
  void stop();

 private:
  struct InFlight {
    OpContext op;
    std::chrono::steady_clock::time_point deadline;
    c10::intrusive_ptr<ShardkitWork> work;
    std::shared_ptr<void> keep_alive;
  };
  void run();
  // One pass over the ops in flight; returns whether any is left. Called with mutex_ not held.
  bool poll();
  void fail_all(const InFlight& culprit, const std::string& reason);

  std::function<std::string()> health_;
  std::function<void(const std::string&)> abort_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<InFlight> in_flight_;  // in issue order: one stream runs them in that order
  bool stopping_ = false;
  bool stopped_ = false;
  std::thread thread_;  // started by the first watch()
};

}  // namespace shardkit::comm

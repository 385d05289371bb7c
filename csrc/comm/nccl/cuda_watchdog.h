// CudaWatchdog: the thread that follows a group's CUDA collectives from issue to their end on the device
// (CUDA builds only).
//
// CudaRoute queues an op on the communication stream and hands it here (watch()); the op's Work has then
// completed as "issued" (work_queue.h), and the caller goes on without waiting. This thread polls the ops in
// flight, oldest first:
//   - done on the device, and the communicator still well: the Work is told (device_finished()) and the
//     references that kept the op's tensors alive are dropped here, so their memory is reused only after the
//     op has read and written it, without recordStream (memory use stays deterministic). (An op whose event
//     fires after an abort was cut short by it: NcclEngine records the failure before aborting, so such an
//     op is always seen failed, never done.)
//   - NCCL reported an asynchronous error or the group failed (`health()` says why), or the op passed its
//     deadline: this op and every later one in flight fail (device_failed()) with a message naming the op, its
//     number and the rank, the message goes to the log at once (a caller may have no Work left to wait on),
//     and only then is the communicator aborted (`abort(reason)`, from this thread: a non-blocking
//     communicator allows it, and its kernels exit, so nothing waits on the stream for ever). Later
//     collectives of the group fail at once with that reason (NcclEngine keeps it). The failed ops' tensors
//     are released once their events fire (the aborted kernels have left), or kept for good after 10 s.
//   - a CUDA error while polling (a sticky error from some kernel) fails the ops the same way; nothing thrown
//     leaves this thread.
// The thread makes the ops' GPU its current device, so it never creates a context on another one.
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
  void watch(const OpContext& op, const c10::Device& device, c10::intrusive_ptr<ShardkitWork> work,
             std::shared_ptr<void> keep_alive);
  // The worker, when an op threw after queuing device work on `stream`: hold `keep_alive` until what was queued
  // has run (the op itself has failed already).
  void hold(const OpContext& op, const c10::Stream& stream, std::shared_ptr<void> keep_alive);
  // Waits until nothing is in flight, then joins the thread (idempotent). Ops handed over afterwards are
  // followed on the caller's thread, until they end.
  void stop();

 private:
  struct InFlight {
    OpContext op;
    std::chrono::steady_clock::time_point deadline;
    c10::intrusive_ptr<ShardkitWork> work;  // null for what hold() keeps
    std::shared_ptr<c10::Event> held;       // hold(): the event after the queued work
    std::shared_ptr<void> keep_alive;
    bool done() const { return work ? work->device_done() : held->query(); }
  };
  void add(InFlight item, c10::Device device);
  void run(c10::Device device);
  // One pass over the ops in flight: retires those done, fails them all on a problem. Returns how many
  // are still in flight and whether the oldest changed (so the caller polls a new op quickly again).
  struct Pass {
    size_t left = 0;
    bool progressed = false;
  };
  Pass poll();
  // Fails `failed` (the oldest with `reason`, the others as behind it), logs, aborts, then releases their
  // references once their kernels have left the device.
  void fail_all(std::deque<InFlight> failed, const std::string& reason);
  // After stop(): follows `item` to its end on this thread (stop() joined the thread: nothing else polls).
  void follow_here(InFlight item);

  std::function<std::string()> health_;
  std::function<void(const std::string&)> abort_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<InFlight> in_flight_;  // in issue order: one stream runs them in that order
  bool stopping_ = false;
  std::thread thread_;  // started by the first op, on that op's device
};

}  // namespace shardkit::comm

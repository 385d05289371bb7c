// ShardkitWork and the backend's worker thread.
//
// Every collective is validated on the calling thread, then queued; one worker thread runs the queue in
// issue order (all ranks must issue collectives in the same order anyway), so the caller — DDP's autograd
// thread, say — goes on while the shared-memory protocol runs. A Work completes its Future with the output
// tensors (what DDP's comm hooks expect) or with the exception the collective threw.
//
// Ops on CUDA tensors complete in two steps (comm/nccl/cuda_route.h): the worker queues them on the group's
// communication stream and the Work completes at once ("issued"), its CUDA Future carrying an event that
// orders consumers' streams after the op; wait() makes the caller's current stream wait for the op, not the
// host. The CUDA watchdog then tracks the op until it is done on the device (device_finished()), or fails
// it (device_failed(): later wait() calls raise the reason).
//
// Future callbacks (`fut.then(...)`) run on the worker thread as it completes the future, and may issue
// and wait on another collective (torch's PowerSGD hook does). Such a collective runs at once, inline on
// the worker: queueing it behind the worker would deadlock, and running it right after the op whose
// completion issued it gives the same order on every rank, whatever the main thread queued meanwhile.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace shardkit::comm {

class ShardkitWork : public c10d::Work {
 public:
  // `seq`: the collective's number in its group (OpContext::seq).
  // `devices`: the CUDA devices of the outputs (empty for host ops). The Future is then a CUDA future: it is
  // completed after the op is on the device, and hands that order to consumers' streams (wait(), then()).
  ShardkitWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
               uint64_t seq, std::vector<c10::Device> devices = {});

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  uint64_t getSequencenumber() const override { return seq_; }

  // Called by the worker thread exactly once. For a device op, issued_on() came first: the Future completes
  // with that stream current, so its events order consumers after the op.
  void complete();
  void fail(std::exception_ptr error);

  // --- device ops (CUDA) ---
  // The worker, once the op is queued on `stream`: records the op's completion event there.
  void issued_on(const c10::Stream& stream);
  // Whether the op is done on the device (a non-blocking query of its event).
  bool device_done() const;
  // The watchdog, exactly once per device op: the op is done on the device, or failed there (timeout, NCCL
  // error) and the communicator was aborted.
  void device_finished();
  void device_failed(std::exception_ptr error);

  // Host ops: done when complete()/fail() ran. Device ops: also done on the device (or failed there).
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // Device ops: the current stream of the op's device waits for the op (the host does not); raises the
  // device failure if the watchdog reported one already. Host ops: only torch's bookkeeping. As torch says,
  // for use after wait() or once isCompleted() is true.
  void synchronize() override;
  // Blocks the host until the op is complete (host ops) or issued (device ops), then synchronize().
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

 private:
  std::exception_ptr device_error() const;
  // Ends the op's profiler span (c10d::Work's RecordFunction) before anyone is woken: a waiter that stops the
  // profiler and exports its trace must not race this thread's write of the span's end (c10d::Work::finish
  // would end it only after the Future has woken its waiters).
  void end_profiler_span();

  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  uint64_t seq_;
  // Device ops: the communication stream and the op's completion event on it (set once, by issued_on(),
  // before the Work completes; read-only afterwards), and what the watchdog reported.
  std::optional<c10::Stream> stream_;
  std::optional<c10::Event> done_;
  mutable std::mutex device_mutex_;
  bool device_finished_ = false;
  std::exception_ptr device_error_;
};

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();  // stop(); on the worker itself (a callback dropped the backend), detaches it instead

  // Runs what is queued, then joins the worker (idempotent). Work arriving afterwards fails at once.
  // Called by the backend's shutdown(), so that no thread of ours outlives destroy_process_group() into
  // interpreter shutdown, where a thread touching Python is terminated.
  void stop();

  // Runs `body` on the worker thread after everything queued before it, then completes `work`
  // (or fails it with whatever `body` threw).
  void enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body);
  // For synchronous callers: if nothing is queued or running, runs `body` right here on the calling
  // thread (saving two thread hand-offs, most of a small collective's latency); otherwise queues it
  // behind the pending work. Either way `work` is completed or failed as by enqueue().
  void run_or_enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body);
  // For direct calls that return no Work (ProcessGroupShardkit::allreduce_now): runs `body` on the calling
  // thread once everything queued before it has run (so it keeps its place in the issue order), rethrowing
  // what it throws; from a future callback on the worker, at once.
  void run_now(const std::function<void()>& body);

 private:
  struct Item {
    c10::intrusive_ptr<ShardkitWork> work;
    std::function<void()> body;
  };
  void submit(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body, bool may_run_inline);
  // The worker's loop; `gone` (shared with the queue) is set when the queue was destroyed on the worker.
  void run(const std::shared_ptr<std::atomic<bool>>& gone);
  // Runs `body`, destroys it (and the tensors it holds), then completes or fails `work`: whoever wait()
  // wakes finds this thread holding none of the op's tensors.
  static void execute(ShardkitWork& work, std::function<void()> body);
  bool on_worker() const { return std::this_thread::get_id() == worker_.get_id(); }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::condition_variable idle_;  // run_now() callers waiting for the queue to drain
  std::deque<Item> items_;
  bool stopping_ = false;
  bool stopped_ = false;  // joined: nothing runs any more
  bool busy_ = false;  // an item is running (on the worker or inline); the next waits for it
  std::shared_ptr<std::atomic<bool>> gone_ = std::make_shared<std::atomic<bool>>(false);  // before worker_
  std::thread worker_;
};

}  // namespace shardkit::comm

#include "comm/work_queue.h"

#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <c10/util/Exception.h>

#include <stdexcept>

namespace shardkit::comm {

namespace {
// The type of every Work's Future value, made once (each make would allocate).
const c10::TypePtr& tensor_list_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

// c10d::Work allocates a RecordFunction for every titled Work, to learn whether a profiler wants it; with
// no RecordFunction callbacks registered (no profiler running) the title is dropped and nothing is made.
const char* title_if_profiled(const char* profiling_title) {
  return at::hasCallbacks() ? profiling_title : nullptr;
}
}  // namespace

ShardkitWork::ShardkitWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
                           uint64_t seq, std::vector<c10::Device> devices)
    : c10d::Work(rank, type, title_if_profiled(profiling_title)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(tensor_list_type(), std::move(devices))),
      seq_(seq) {}

void ShardkitWork::end_profiler_span() {
  std::function<void()> end;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    end.swap(recordFunctionEndCallback_);
  }
  if (end) end();
}

void ShardkitWork::complete() {
  end_profiler_span();
  {
    // A device op's Future records its events on the current stream of each device: the communication
    // stream, so consumers are ordered after the op, not after whatever else the device's default stream holds.
    std::optional<c10::StreamGuard> on_stream;
    if (stream_) on_stream.emplace(*stream_);
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish();
}

void ShardkitWork::issued_on(const c10::Stream& stream) {
  TORCH_INTERNAL_ASSERT(!done_, "ShardkitWork::issued_on called twice");
  c10::Event done(stream.device_type());
  done.record(stream);
  stream_ = stream;
  done_.emplace(std::move(done));
}

bool ShardkitWork::device_done() const { return !done_ || done_->query(); }

void ShardkitWork::device_finished() {
  std::lock_guard<std::mutex> lock(device_mutex_);
  device_finished_ = true;
}

void ShardkitWork::device_failed(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(device_mutex_);
  device_finished_ = true;
  device_error_ = std::move(error);
}

std::exception_ptr ShardkitWork::device_error() const {
  std::lock_guard<std::mutex> lock(device_mutex_);
  return device_error_;
}

bool ShardkitWork::isCompleted() {
  if (!c10d::Work::isCompleted()) return false;
  if (!done_) return true;
  std::lock_guard<std::mutex> lock(device_mutex_);
  return device_finished_;
}

bool ShardkitWork::isSuccess() const { return c10d::Work::isSuccess() && device_error() == nullptr; }

std::exception_ptr ShardkitWork::exception() const {
  std::exception_ptr host = c10d::Work::exception();
  return host ? host : device_error();
}

void ShardkitWork::synchronize() {
  c10d::Work::synchronize();  // torch's bookkeeping of waited collectives
  if (!done_) return;
  if (std::exception_ptr error = device_error()) std::rethrow_exception(error);
  const c10::Device device = done_->device();
  const c10::impl::VirtualGuardImpl guard(device.type());
  done_->block(guard.getStream(device));
}

bool ShardkitWork::wait(std::chrono::milliseconds timeout) {
  {
    // As c10d::Work::wait, but synchronize() runs after the lock is released (it reads the device state,
    // whose accessors must not be called under Work's mutex).
    std::unique_lock<std::mutex> lock(mutex_);
    const auto done = [this] { return completed_; };
    if (timeout == kNoTimeout) {
      cv_.wait(lock, done);
    } else if (!cv_.wait_for(lock, timeout, done)) {
      TORCH_CHECK(false, "shardkit: Work.wait(timeout=", timeout.count(), " ms) timed out: the collective #", seq_,
                  " has not ", done_ ? "been issued" : "completed", " yet");
    }
    if (exception_) std::rethrow_exception(exception_);
  }
  synchronize();
  return true;
}

void ShardkitWork::fail(std::exception_ptr error) {
  end_profiler_span();
  future_->setError(error);
  finish(error);
}

namespace {
void fail_stopped(ShardkitWork& work) {
  work.fail(std::make_exception_ptr(
      std::runtime_error("shardkit: the process group was shut down (destroy_process_group); no collective can run")));
}
}  // namespace

WorkQueue::WorkQueue() : worker_([this, gone = gone_] { run(gone); }) {}

WorkQueue::~WorkQueue() {
  if (!on_worker()) {
    stop();
    return;
  }
  // Destroyed on its own worker: a future callback run there dropped the last reference to the backend. The thread
  // cannot join itself (a joinable std::thread destroyed terminates the process), so it is detached and told not to
  // touch this queue again (run() looks at `gone` once the item that got here returns), and what is still queued
  // fails instead of waiting for a worker that will not run it.
  std::deque<Item> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    left.swap(items_);
  }
  gone_->store(true);
  worker_.detach();
  for (Item& item : left) fail_stopped(*item.work);
}

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopping_ = true;
  }
  ready_.notify_one();
  // From the worker itself (a callback shutting the group down) there is nothing to join yet: the worker ends once
  // drained, and a later stop() or the destructor, from another thread, joins it.
  if (on_worker()) return;
  worker_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_ = true;
}


void WorkQueue::enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body) {
  submit(std::move(work), std::move(body), /*may_run_inline=*/false);
}

void WorkQueue::run_or_enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body) {
  submit(std::move(work), std::move(body), /*may_run_inline=*/true);
}

void WorkQueue::submit(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body, bool may_run_inline) {
  if (on_worker()) {  // issued from a future callback: run now (see the header)
    execute(*work, std::move(body));
    return;
  }
  bool stopped = false;
  bool run_here = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      stopped = true;
    } else if (may_run_inline && items_.empty() && !busy_) {
      busy_ = true;
      run_here = true;
    } else {
      items_.push_back({std::move(work), std::move(body)});
    }
  }
  if (stopped) {  // outside the lock: failing runs the future's callbacks, which may submit again
    fail_stopped(*work);
    return;
  }
  if (!run_here) {
    ready_.notify_one();
    return;
  }
  execute(*work, std::move(body));
  bool queued_meanwhile = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    queued_meanwhile = !items_.empty();
  }
  if (queued_meanwhile) ready_.notify_one();  // waking an idle worker for nothing costs small ops dearly
  idle_.notify_all();  // cheap without waiters
}

void WorkQueue::execute(ShardkitWork& work, std::function<void()> body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  // The body holds the op's tensors (inputs included). It goes before the Work wakes anyone: a caller whose
  // wait() returns and drops its tensors then frees their memory at once, not whenever this thread next gets a
  // core (on a busy host that can be after the caller has allocated the next op's buffers).
  body = nullptr;
  if (error) {
    work.fail(error);
  } else {
    work.complete();
  }
}

void WorkQueue::run(const std::shared_ptr<std::atomic<bool>>& gone) {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return (stopping_ && !busy_) || (!items_.empty() && !busy_); });
      if (items_.empty()) return;  // stopping and drained
      item = std::move(items_.front());
      items_.pop_front();
      busy_ = true;
    }
    c10::intrusive_ptr<ShardkitWork> work = std::move(item.work);
    execute(*work, std::move(item.body));
    work.reset();  // this thread's reference goes at once: the Work's outputs then live as long as the caller's
    if (gone->load()) return;  // the queue was destroyed by what ran (see the destructor): touch nothing of it
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
    idle_.notify_all();
  }
}

void WorkQueue::run_now(const std::function<void()>& body) {
  if (on_worker()) {
    body();
    return;
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return stopping_ || (items_.empty() && !busy_); });
    TORCH_CHECK(!stopping_, "shardkit: the process group was shut down (destroy_process_group); no collective can run");
    busy_ = true;
  }
  // Whatever body() does, the queue is released and a worker woken for what was queued meanwhile.
  struct Release {
    WorkQueue& queue;
    ~Release() {
      bool queued_meanwhile = false;
      {
        std::lock_guard<std::mutex> lock(queue.mutex_);
        queue.busy_ = false;
        queued_meanwhile = !queue.items_.empty();
      }
      if (queued_meanwhile) queue.ready_.notify_one();
      queue.idle_.notify_all();
    }
  } release{*this};
  body();
}

}  // namespace shardkit::comm

#include "comm/work_queue.h"

#include <stdexcept>

namespace shardkit::comm {

ShardkitWork::ShardkitWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
                           uint64_t seq, std::vector<c10::Device> devices)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::move(devices))),
      seq_(seq) {}

void ShardkitWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void ShardkitWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

WorkQueue::WorkQueue() : worker_([this] { run(); }) {}

WorkQueue::~WorkQueue() { stop(); }

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopping_ = true;
  }
  ready_.notify_one();
  if (!on_worker()) worker_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_ = true;
}

namespace {
void fail_stopped(ShardkitWork& work) {
  work.fail(std::make_exception_ptr(
      std::runtime_error("shardkit: the process group was shut down (destroy_process_group); no collective can run")));
}
}  // namespace

void WorkQueue::enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body) {
  submit(std::move(work), std::move(body), /*may_run_inline=*/false);
}

void WorkQueue::run_or_enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body) {
  submit(std::move(work), std::move(body), /*may_run_inline=*/true);
}

void WorkQueue::submit(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body, bool may_run_inline) {
  if (on_worker()) {  // issued from a future callback: run now (see the header)
    execute(*work, body);
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
  execute(*work, body);
  bool queued_meanwhile = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    queued_meanwhile = !items_.empty();
  }
  if (queued_meanwhile) ready_.notify_one();  // waking an idle worker for nothing costs small ops dearly
}

void WorkQueue::execute(ShardkitWork& work, const std::function<void()>& body) {
  try {
    body();
    work.complete();
  } catch (...) {
    work.fail(std::current_exception());
  }
}

void WorkQueue::run() {
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
    execute(*item.work, item.body);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
  }
}

}  // namespace shardkit::comm

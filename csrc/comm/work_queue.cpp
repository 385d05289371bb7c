#include "comm/work_queue.h"

namespace shardkit::comm {

ShardkitWork::ShardkitWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void ShardkitWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void ShardkitWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

WorkQueue::WorkQueue() : worker_([this] { run(); }) {}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_one();
  worker_.join();
}

void WorkQueue::enqueue(c10::intrusive_ptr<ShardkitWork> work, std::function<void()> body) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back({std::move(work), std::move(body)});
  }
  ready_.notify_one();
}

void WorkQueue::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !items_.empty(); });
      if (items_.empty()) return;  // stopping and drained
      item = std::move(items_.front());
      items_.pop_front();
    }
    try {
      item.body();
      item.work->complete();
    } catch (...) {
      item.work->fail(std::current_exception());
    }
  }
}

}  // namespace shardkit::comm

#include "core/collective_sequencer.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardkit::core {

uint64_t CollectiveSequencer::reserve(uint64_t count) {
  if (count == 0) throw std::invalid_argument("CollectiveSequencer::reserve: count must be at least 1, got 0");
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t first = reserved_;
  reserved_ += count;
  return first;
}

void CollectiveSequencer::submit(uint64_t ticket, Run run, Abandon abandon) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (ticket >= reserved_ || ticket < next_ || stored_.count(ticket) != 0) {
    const std::string why = ticket >= reserved_ ? " was never reserved (reserved: " + std::to_string(reserved_) + ")"
                                                : " was submitted before (next to run: " + std::to_string(next_) + ")";
    throw std::logic_error("CollectiveSequencer::submit: ticket " + std::to_string(ticket) + why);
  }
  if (error_) {
    std::exception_ptr error = error_;
    lock.unlock();
    abandon(error);
    return;
  }
  stored_.emplace(ticket, Step{std::move(run), std::move(abandon)});
  // Someone else drains (another thread, or this very thread further up its stack: a step's collective
  // completed inline and its callback submitted this one): the loop will pick it up.
  if (draining_ || ticket != next_) return;
  draining_ = true;
  drain(lock);
}

void CollectiveSequencer::drain(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    auto it = stored_.find(next_);
    if (error_ || it == stored_.end()) {  // after a failure stored_ is empty: fail() abandoned them
      draining_ = false;
      return;
    }
    Step step = std::move(it->second);
    stored_.erase(it);
    ++next_;  // before running: the step after it, if this run submits it re-entrantly, is stored as next
    lock.unlock();
    try {
      step.run();
    } catch (...) {  // its collective may or may not have been issued: the order is lost
      const std::exception_ptr error = std::current_exception();
      fail(error);
      step.abandon(error);
    }
    lock.lock();
  }
}

void CollectiveSequencer::fail(std::exception_ptr error) {
  std::vector<Step> abandoned;
  std::exception_ptr first;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::move(error);
    first = error_;
    for (auto& entry : stored_) abandoned.push_back(std::move(entry.second));
    stored_.clear();
  }
  for (Step& step : abandoned) step.abandon(first);
}

bool CollectiveSequencer::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(error_);
}

uint64_t CollectiveSequencer::next() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_;
}

uint64_t CollectiveSequencer::reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

}  // namespace shardkit::core

// Point-to-point exchanges of HierarchicalEngine: start_exchange posts one send and one receive per other host on this
// rank's rail, every transfer at once (gloo's all-to-all moves one direction at a time: half the link's rate,
// measured), and hands their Works to the engine's ExchangeWaiter (hierarchical_internal.h has its protocol), whose
// one thread waits for them.
//
// Promise: the Work start_exchange returns behaves like a gloo collective's under wait_inner: wait(slice) returns or
// throws within the slice, and a failure names the peer it could not reach (on a cut link, the host). Every wait has
// the op's deadline; the engine's shutdown wakes the thread from any of them and joins it.
#include "comm/hierarchical_engine.h"

#include <algorithm>

#include "comm/hierarchical_internal.h"

namespace shardkit::comm {

using namespace hierarchical;

namespace {

// One exchange as its caller sees it: the outcome ExchangeWaiter records.
class PointToPointWork : public c10d::Work {
 public:
  explicit PointToPointWork(std::shared_ptr<ExchangeWaiter::Outcome> outcome) : outcome_(std::move(outcome)) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(outcome_->mutex);
    return outcome_->done;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(outcome_->mutex);
    if (timeout == kNoTimeout) {
      outcome_->changed.wait(lock, [&] { return outcome_->done; });
    } else if (!outcome_->changed.wait_for(lock, timeout, [&] { return outcome_->done; })) {
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
    }
    if (outcome_->error) std::rethrow_exception(outcome_->error);
    return true;
  }

 private:
  std::shared_ptr<ExchangeWaiter::Outcome> outcome_;
};

}  // namespace

void ExchangeWaiter::Outcome::finish(std::exception_ptr failure) {
  std::lock_guard<std::mutex> lock(mutex);
  error = std::move(failure);
  done = true;
  changed.notify_all();
}

ExchangeWaiter::ExchangeWaiter() : thread_([this] { run(); }) {}

c10::intrusive_ptr<c10d::Work> ExchangeWaiter::post(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                                                    std::vector<std::string> peer_of,
                                                    std::chrono::milliseconds timeout) {
  auto outcome = std::make_shared<Outcome>();
  Exchange exchange{std::move(works), std::move(peer_of), std::chrono::steady_clock::now() + timeout, outcome};
  bool refused = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refused = stopping_;
    if (!refused) queue_.push_back(std::move(exchange));
  }
  if (refused) {
    abort_works(exchange);  // nobody will wait for them
    outcome->finish(
        std::make_exception_ptr(std::runtime_error("the exchange could not start: the engine was shut down")));
  } else {
    posted_.notify_one();
  }
  return c10::make_intrusive<PointToPointWork>(std::move(outcome));
}

void ExchangeWaiter::run() {
  using clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    posted_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every exchange reported
    current_ = std::move(queue_.front());
    queue_.pop_front();
    const Exchange& exchange = *current_;  // only read outside the lock (stop() reads it too)
    lock.unlock();
    std::exception_ptr error;
    for (size_t i = 0; i < exchange.works.size(); ++i) {
      try {
        const auto left = std::chrono::duration_cast<milliseconds>(exchange.deadline - clock::now());
        // False: stop() aborted it (c10d::Work::abort).
        if (!exchange.works[i]->wait(std::max(left, milliseconds(1)))) {
          throw std::runtime_error("given up: the engine was shut down while it was in flight");
        }
      } catch (const std::exception& failure) {
        if (!error) {
          error = std::make_exception_ptr(
              std::runtime_error("the exchange with " + exchange.peer_of[i] + ": " + message_of(failure)));
        }
      }
    }
    exchange.outcome->finish(error);
    lock.lock();
    current_.reset();
  }
}

void ExchangeWaiter::abort_works(const Exchange& exchange) {
  for (const auto& work : exchange.works) {
    try {
      work->abort();
    } catch (const std::exception&) {
      // A Work without abort (gloo's send and receive have it) is left to end at its deadline.
    }
  }
}

void ExchangeWaiter::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      stopping_ = true;
      if (current_) abort_works(*current_);
      for (const Exchange& exchange : queue_) abort_works(exchange);
    }
  }
  posted_.notify_all();
  if (thread_.joinable()) thread_.join();
}

c10::intrusive_ptr<c10d::Work> HierarchicalEngine::start_exchange(const OpContext& op, c10d::Backend& backend,
                                                                  const std::vector<at::Tensor>& to_peer,
                                                                  const std::vector<at::Tensor>& from_peer, int tag) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::string> peer_of;
  for (size_t i = 0; i < to_peer.size(); ++i) {
    // The inter-host backends are ranked by host: peer i is the i-th other host, its rank at this rank's position.
    const int host = static_cast<int>(i) < host_ ? static_cast<int>(i) : static_cast<int>(i) + 1;
    const std::string who = "rank " + std::to_string(notices_->global_rank(hosts_[host][local_rank_])) + " (host " +
                            std::to_string(host) + ")";
    if (from_peer[i].defined()) {
      std::vector<at::Tensor> incoming{as_bytes(from_peer[i])};
      works.push_back(backend.recv(incoming, host, tag));
      peer_of.push_back(who);
    }
    if (to_peer[i].defined()) {
      std::vector<at::Tensor> outgoing{as_bytes(to_peer[i])};
      inter_host_bytes_.fetch_add(to_peer[i].nbytes(), std::memory_order_relaxed);
      works.push_back(backend.send(outgoing, host, tag));
      peer_of.push_back(who);
    }
  }
  return exchanges_->post(std::move(works), std::move(peer_of), op.left());
}

}  // namespace shardkit::comm

// The failure protocol of HierarchicalEngine (hierarchical_engine.h, "Failure"): every collective runs guarded
// (hierarchical_internal.h); a failing step publishes its reason in the group's Store, aborts this host's shm group
// and closes the gloo backends, so that every rank of every host fails within about the time the first one takes to
// notice. wait_inner is every wait on an inner gloo op: in slices, to the op's deadline, watching for an abort here
// and for the group's notice.
//
// Promise: every wait has a deadline; the first reason stands (later failures report it as the root cause); an op
// given up on while it may still run abandons its backend (InnerBackends::abandon) instead of dropping it; messages
// name the user's op, its number and global ranks.
#include "comm/hierarchical_engine.h"

#include <algorithm>
#include <thread>

#include "comm/hierarchical_internal.h"

namespace shardkit::comm {

using namespace hierarchical;

namespace {

// When a gloo step fails (a connection closed), the rank that closed it has usually published why, or its
// host's other ranks will within their liveness check (~0.2 s): wait this long for that root cause.
constexpr auto kRootCauseWait = std::chrono::milliseconds(1000);
// A leader waiting on gloo checks for an abort this often (in-process at once; the Store's notice at this pace).
constexpr auto kNoticeEvery = std::chrono::milliseconds(100);

// Past an op's deadline, how long a wait gives the inner op to end with an error of its own (see wait_inner).
constexpr auto kOwnErrorWait = std::chrono::milliseconds(1000);

}  // namespace

std::string HierarchicalEngine::aborted_reason() const {
  if (!is_aborted_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return aborted_;
}

bool HierarchicalEngine::abort_here(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (is_aborted_.load(std::memory_order_relaxed)) return false;
    aborted_ = reason;
    is_aborted_.store(true, std::memory_order_release);
  }
  local_->abort(reason);  // wakes this host's ranks (no-op if the shm group aborted itself)
  inner_->close(reason);  // closes the gloo connections: blocked peers on other hosts fail now
  return true;
}

void HierarchicalEngine::abort(const std::string& reason) {
  if (!abort_here(reason)) return;
  // Peers on other hosts read it (once their connection drops, or at their next look at the Store); written on a
  // thread of its own, so that an abort from another group's failure never waits for the Store.
  std::thread([notices = notices_, reason] { notices->publish(reason); }).detach();
}

void HierarchicalEngine::abort_everywhere(const OpContext& op, const std::string& reason, bool await_root_cause) {
  std::optional<std::string> cause;  // another rank's reason, which this failure only follows from
  std::string mine = reason;
  if (await_root_cause) {
    // Said first, so that leaders waiting for a root cause at the same time see each other's hosts as alive.
    notices_->mark_failed(reason);
    cause = notices_->await_root_cause(kRootCauseWait);
    if (!cause) {
      if (const std::string silent = notices_->silent_ranks(); !silent.empty()) {
        mine += "; rank(s) " + silent + " went silent: no rank of their host(s) reported a failure within " +
                std::to_string(kRootCauseWait.count()) + " ms (they exited or were killed, lost the network, or are "
                "not in this collective)";
      }
    }
  }
  if (!cause) {  // (a cause found above: this rank has marked itself failed already, and the notice stands)
    if (const std::string first = notices_->publish(mine); first != mine) cause = first;
  }
  const std::string message = cause ? op.where() + "group aborted: " + *cause : mine;
  abort_here(message);
  throw std::runtime_error(message);
}

void HierarchicalEngine::wait_inner(const OpContext& op, const char* step, c10::intrusive_ptr<c10d::Backend>& backend,
                                    const c10::intrusive_ptr<c10d::Work>& work) {
  using clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  const auto deadline = op.deadline();  // the op's, shared by all its steps
  // In slices: a completed op ends a slice at once (the Work's condition variable); between slices, this rank
  // looks for an abort (another group of the process failed) and for the group's notice (a rank elsewhere did).
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - clock::now());
    try {
      work->wait(std::clamp(left, milliseconds(1), std::chrono::duration_cast<milliseconds>(kNoticeEvery)));
      return;
    } catch (const std::exception& error) {
      // Only this slice ended, the op failed, or the deadline passed (the op still in flight: abandoned). An op that
      // completed just after its slice timed out is judged by its own outcome, not by the slice's "timed out".
      if (work->isCompleted()) {
        try {
          work->wait();
          return;
        } catch (const std::exception& failure) {
          throw InnerStepError(op.where() + step + " failed: " + message_of(failure));
        }
      }
      if (clock::now() >= deadline) {
        // The inner op waits to the same deadline (an exchange's peers, start_exchange): a moment more lets it end
        // with its own error, which names the peer it could not reach, rather than with a bare "timed out".
        try {
          work->wait(kOwnErrorWait);
          return;
        } catch (const std::exception& failure) {
          if (work->isCompleted()) throw InnerStepError(op.where() + step + " failed: " + message_of(failure));
        }
        InnerBackends::abandon(std::move(backend));
        throw InnerStepError(op.where() + step + " did not finish within the op's timeout of " +
                             std::to_string(op.timeout.count()) + " ms: " + message_of(error));
      }
    }
    std::optional<std::string> cause;
    if (const std::string reason = aborted_reason(); !reason.empty()) {
      cause = reason;
    } else {
      cause = notices_->root_cause();
    }
    if (cause) {
      InnerBackends::abandon(std::move(backend));  // the op may still run on it (see inner_backends.h)
      throw std::runtime_error(op.where() + "group aborted: " + *cause);
    }
  }
}

}  // namespace shardkit::comm

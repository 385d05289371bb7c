// FailureNotices: what the ranks of a job tell each other through the c10d Store when something fails, so that
// every survivor — on any host, in any group — names the root cause (a dead rank by its global rank, or the first
// error) instead of the symptom it saw ("Connection closed by peer") or a deadline.
//
// Keys, in the group's Store:
//   shardkit/abort          the group's first failure, as text. compareSet: the first writer wins, so every rank
//                           reads the same root cause. Written by the backend's start-up (python/shardkit/
//                           _startup.py: a rank that fails, or sees a peer die, before the group exists) and by a
//                           rank whose collective fails; read while waiting (start-up, inter-host steps).
//   shardkit/failed/<r>     group rank r has failed and said so (value: its message), written before it waits for a
//                           root cause. A host none of whose ranks wrote one while a connection to it dropped has
//                           gone silent: its ranks are named.
// In the job's Store (the world group's; the group's own where the world group is not shardkit's):
//   shardkit/deaths         how many deaths were recorded (Store::add)
//   shardkit/death/<i>      the i-th: "<global rank> <message of the rank that saw it exit>". A death is seen by a
//                           rank on the dead rank's host (its pid is gone) in whichever group they share; a group
//                           elsewhere whose connection to the dead rank dropped finds it here.
//
// The Store may live on a host that is gone. Every call therefore runs with a deadline (kStoreDeadline) on a thread
// of its own; one that misses it marks the Store unreachable, and later calls answer at once as if nothing were
// there: callers fall back to what they saw themselves. Safe to use from several threads.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/liveness.h"

namespace shardkit::comm {

// The key the start-up and every failing rank write the group's root cause under (python/shardkit/_startup.py
// writes it too; it reads the name from _C.ABORT_KEY).
inline constexpr const char* kAbortKey = "shardkit/abort";

class FailureNotices {
 public:
  static constexpr std::chrono::milliseconds kStoreDeadline{500};

  // `ranks`: the group's ranks as messages name them (global ranks) and their pids; `host_of[r]`: group rank r's host
  // index (empty: one host). `job_store` may be null: deaths then go to the group's Store.
  FailureNotices(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> job_store, int rank,
                 core::PeerNames ranks, std::vector<int> host_of);

  // Marks this rank failed (it has spoken: its host is not silent), without a root cause yet.
  void mark_failed(const std::string& reason);
  // mark_failed, then writes `reason` as the group's root cause unless another rank did first. Returns the group's
  // root cause (`reason` itself if this rank was first, or the Store cannot be reached).
  std::string publish(const std::string& reason);
  // The group's root cause if anyone wrote one, else a recorded death of one of this group's ranks; nullopt if
  // neither (yet), or the Store cannot be reached.
  std::optional<std::string> root_cause();
  // root_cause(), polled until it answers or `patience` passes.
  std::optional<std::string> await_root_cause(std::chrono::milliseconds patience);
  // Records, for the whole job, that these ranks (global rank, pid) exited, as `message` (the seeing rank's error)
  // says. In the background: the caller does not wait for the Store.
  void record_deaths(const std::vector<std::pair<int, int32_t>>& exited, const std::string& message);
  // The ranks of the hosts (other than this rank's) none of whose ranks has marked itself failed: "2 (pid 4242)"
  // and so on; empty if every host has spoken, or the Store cannot be reached. For a connection that dropped with no
  // reason given.
  std::string silent_ranks();

  int global_rank(int r) const { return ranks_.name(r); }
  const c10::intrusive_ptr<c10d::Store>& job_store() const { return job_store_; }

 private:
  // `call()` on a thread of its own, waited for at most kStoreDeadline; nullopt if it threw, or did not answer in
  // time (then the Store counts as unreachable from now on).
  template <typename T, typename Call>
  std::optional<T> ask(Call call);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> job_store_;
  int rank_;
  core::PeerNames ranks_;
  std::vector<int> host_of_;
  std::atomic<bool> unreachable_{false};
  std::mutex deaths_mutex_;
  int64_t deaths_read_ = 0;  // death records already looked at (under deaths_mutex_)
};

}  // namespace shardkit::comm

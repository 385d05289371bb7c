// FailureNotices: what the ranks of a job tell each other through the c10d Store when something fails, so that
// every survivor — on any host, in any group — names the root cause (a dead rank by its global rank, or the first
// error) instead of the symptom it saw ("Connection closed by peer") or a deadline.
//
// Keys, in the group's Store:
//   shardkit/abort          the group's first failure, as text. compareSet: the first writer wins, so every rank
//                           reads the same root cause. Written by the backend's start-up (python/shardkit/
//                           _startup.py: a rank that fails, or sees a peer die, before the group exists) and by a
//                           rank whose collective fails; read while waiting (start-up, inter-host steps).
//   shardkit/failed/<r>     group rank r has failed and said so (value: its message). A host none of whose ranks
//                           wrote one while a connection to it dropped has gone silent: its ranks are named.
// In the job's Store (the world group's; the group's own where the world group is not shardkit's):
//   shardkit/deaths         how many deaths were recorded (Store::add)
//   shardkit/death/<i>      the i-th: "<global rank> <message of the rank that saw it exit>". A death is seen by a
//                           rank on the dead rank's host (its pid is gone) in whichever group they share; a group
//                           elsewhere whose connection to the dead rank dropped finds it here.
//
// Every call swallows Store errors (the Store may live in the process that died): a notice that cannot be written
// or read is simply not there, and callers fall back to what they saw themselves.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardkit::comm {

// The key the start-up and every failing rank write the group's root cause under (python/shardkit/_startup.py
// writes it too; it reads the name from _C.ABORT_KEY).
inline constexpr const char* kAbortKey = "shardkit/abort";

class FailureNotices {
 public:
  // `global_ranks[r]`: the global rank of group rank r; `host_of[r]`: its host index (empty: one host); `pids[r]`:
  // its pid (0 unknown). `job_store` may be null: deaths then go to the group's Store.
  FailureNotices(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> job_store, int rank,
                 std::vector<int> global_ranks, std::vector<int> host_of, std::vector<int32_t> pids);

  // Writes `reason` as the group's root cause unless another rank did first, and marks this rank failed. Returns
  // the group's root cause (`reason` itself if this rank was first, or the Store cannot be reached).
  std::string publish(const std::string& reason);
  // The group's root cause if anyone wrote one, else a recorded death of one of this group's ranks; nullopt if
  // neither (yet). One or two Store round trips.
  std::optional<std::string> root_cause();
  // root_cause(), polled until it answers or `patience` passes.
  std::optional<std::string> await_root_cause(std::chrono::milliseconds patience);
  // Records, for the whole job, that these ranks (global rank, pid) exited, as `message` (the seeing rank's error)
  // says.
  void record_deaths(const std::vector<std::pair<int, int32_t>>& exited, const std::string& message);
  // The ranks of the hosts (other than this rank's) none of whose ranks has marked itself failed: "2 (pid 4242)"
  // and so on; empty if every host has spoken. For a connection that dropped with no reason given.
  std::string silent_ranks();

  int global_rank(int r) const { return r >= 0 && r < static_cast<int>(global_ranks_.size()) ? global_ranks_[r] : r; }

 private:
  std::optional<std::string> get_if_set(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> job_store_;
  int rank_;
  std::vector<int> global_ranks_;
  std::vector<int> host_of_;
  std::vector<int32_t> pids_;
  int64_t deaths_read_ = 0;  // death records already looked at
};

}  // namespace shardkit::comm

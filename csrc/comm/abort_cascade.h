// AbortCascade: every shardkit group of this process, so that one failure ends them all.
//
// A rank whose collective failed (a peer died, ranks disagreed, a deadline passed) will not issue the job's later
// collectives as its peers expect. Peers waiting for it in another group — the replicate group of HYBRID_SHARD
// when the shard group saw the death, the world group when a subgroup did — must learn that now, not at their
// deadline. So the backend that sees a failure aborts the process's other groups with the same reason: their waits
// end at once, their peers on this host wake through the shared segment, and those on other hosts through the
// closed connections and the Store notice (failure_notices.h). The reason names the root cause (a dead rank by its
// global rank), so every survivor's error does too.
//
// A group whose failure the job survives (ProcessGroupShardkit::Config::isolated: torchft's cross-replica group)
// does not join: its failure aborts no other group, and no other group's aborts it.
//
// Each group joins with the function that aborts it (holding what it aborts weakly: a group destroyed meanwhile is
// simply skipped). abort_others copies the functions under the registry's lock and calls them outside it, so an
// abort that takes time (a Store on a slow host) holds up neither other aborts nor a group's destruction.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace shardkit::comm {

class AbortCascade {
 public:
  using Abort = std::function<void(const std::string& reason)>;

  // Registers a group's abort; the token identifies it until leave().
  static uint64_t join(Abort abort);
  static void leave(uint64_t token);
  // Calls every registered abort but `except`'s with `reason`. Aborts are idempotent (the first reason stands).
  static void abort_others(uint64_t except, const std::string& reason);
};

}  // namespace shardkit::comm

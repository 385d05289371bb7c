// AbortCascade: every shardkit group of this process, so that one failure ends them all.
//
// A rank whose collective failed (a peer died, ranks disagreed, a deadline passed) will not issue the job's later
// collectives as its peers expect. Peers waiting for it in another group — the replicate group of HYBRID_SHARD
// when the shard group saw the death, the world group when a subgroup did — must learn that now, not at their
// deadline. So the backend that sees a failure aborts the process's other groups with the same reason
// (Engine::abort): their waits end at once, their peers on this host wake through the shared segment, and those on
// other hosts through the closed connections and the Store notice (failure_notices.h). The reason names the
// root cause (a dead rank by its global rank), so every survivor's error does too.
#pragma once

#include <string>

namespace shardkit::comm {

class Engine;

class AbortCascade {
 public:
  // A group's engine, from its construction until its shutdown or destruction.
  static void join(Engine* engine);
  static void leave(Engine* engine);
  // Aborts every joined engine but `failed` with `reason`. Engines abort idempotently (the first reason stands).
  static void abort_others(const Engine* failed, const std::string& reason);
};

}  // namespace shardkit::comm

// Whether another process of this machine is still alive: how the shared-memory engine tells a peer that is slow
// from one that is gone, and names the dead one instead of waiting out a deadline.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardkit::core {

// True when `pid` no longer exists or has exited and waits to be reaped (a zombie: ranks that are siblings
// under one launcher stay zombies until it reaps them). False for a live process, and for pid <= 0 (unknown).
bool process_exited(int32_t pid);

// The peers a wait depends on, as messages name them: this group's rank r is "rank names[r]" (its global rank)
// and runs as pids[r] (0 where not known yet). Either vector may be empty: the group's own numbering, no pids.
struct PeerNames {
  std::vector<int> names;
  std::vector<int32_t> pids;

  int name(int r) const { return r >= 0 && r < static_cast<int>(names.size()) ? names[r] : r; }
  int32_t pid(int r) const { return r >= 0 && r < static_cast<int>(pids.size()) ? pids[r] : 0; }
  // "3 (pid 8600), 5 (pid 8602)" for the given group ranks whose pids are known to have exited; empty if none.
  std::string exited(const std::vector<int>& ranks) const;
};

}  // namespace shardkit::core

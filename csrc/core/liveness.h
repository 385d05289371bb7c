// Whether another process of this machine is still alive: how the shared-memory engine tells a peer that is slow
// from one that is gone, and names the dead one instead of waiting out a deadline.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace shardkit::core {

// True when `pid` no longer exists or has exited and waits to be reaped (a zombie: ranks that are siblings
// under one launcher stay zombies until it reaps them). False for a live process, and for pid <= 0 (unknown, or not
// to be watched).
bool process_exited(int32_t pid);

// A pid that must not be watched: the peer runs in another pid namespace (a container sharing the host's /dev/shm
// but not its pids), where its pid means nothing here.
inline constexpr int32_t kUnwatchedPid = -1;

// The peers a wait depends on, as messages name them: this group's rank r is "rank names[r]" (its global rank)
// and runs as pids[r] (0 where not known yet, kUnwatchedPid where it cannot be watched). Either vector may be
// empty: the group's own numbering, no pids.
struct PeerNames {
  std::vector<int> names;
  std::vector<int32_t> pids;

  int name(int r) const { return r >= 0 && r < static_cast<int>(names.size()) ? names[r] : r; }
  int32_t pid(int r) const { return r >= 0 && r < static_cast<int>(pids.size()) ? pids[r] : 0; }
  // (name, pid) of each of the given group ranks whose process has exited; `pid_of` (default: pid()) says where
  // each runs.
  std::vector<std::pair<int, int32_t>> exited(const std::vector<int>& ranks,
                                              const std::function<int32_t(int)>& pid_of = {}) const;
};

// "3 (pid 8600), 5 (pid 8602)".
std::string describe_exited(const std::vector<std::pair<int, int32_t>>& exited);

}  // namespace shardkit::core

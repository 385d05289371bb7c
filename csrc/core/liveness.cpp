#include "core/liveness.h"

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace shardkit::core {

bool process_exited(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* stat = std::fopen(path, "r");
  if (stat == nullptr) return false;
  char state = '?';
  // Format: "pid (comm) state ..."; comm may contain spaces and parentheses, so find the last ')'.
  char line[512];
  if (std::fgets(line, sizeof(line), stat) != nullptr) {
    const char* close = std::strrchr(line, ')');
    if (close != nullptr && close[1] == ' ') state = close[2];
  }
  std::fclose(stat);
  return state == 'Z' || state == 'X';
}

std::string PeerNames::exited(const std::vector<int>& ranks) const {
  std::string dead;
  for (int r : ranks) {
    const int32_t p = pid(r);
    if (p > 0 && process_exited(p)) {
      dead += (dead.empty() ? "" : ", ") + std::to_string(name(r)) + " (pid " + std::to_string(p) + ")";
    }
  }
  return dead;
}

}  // namespace shardkit::core

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

std::vector<std::pair<int, int32_t>> PeerNames::exited(const std::vector<int>& ranks,
                                                       const std::function<int32_t(int)>& pid_of) const {
  std::vector<std::pair<int, int32_t>> gone;
  for (int r : ranks) {
    const int32_t p = pid_of ? pid_of(r) : pid(r);
    if (process_exited(p)) gone.emplace_back(name(r), p);
  }
  return gone;
}

std::string describe_exited(const std::vector<std::pair<int, int32_t>>& exited) {
  std::string text;
  for (const auto& [name, pid] : exited) {
    text += (text.empty() ? "" : ", ") + std::to_string(name) + " (pid " + std::to_string(pid) + ")";
  }
  return text;
}

}  // namespace shardkit::core

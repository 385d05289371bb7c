#include "comm/abort_cascade.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace shardkit::comm {

namespace {

struct Registry {
  std::mutex mutex;
  uint64_t next_token = 1;
  std::map<uint64_t, AbortCascade::Abort> aborts;
};

// Never destroyed: a worker thread may cascade a failure while the process exits.
Registry& registry() {
  static auto* registry = new Registry;
  return *registry;
}

}  // namespace

uint64_t AbortCascade::join(Abort abort) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const uint64_t token = r.next_token++;
  r.aborts.emplace(token, std::move(abort));
  return token;
}

void AbortCascade::leave(uint64_t token) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.aborts.erase(token);
}

void AbortCascade::abort_others(uint64_t except, const std::string& reason) {
  std::vector<Abort> others;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [token, abort] : r.aborts) {
      if (token != except) others.push_back(abort);
    }
  }
  for (const Abort& abort : others) abort(reason);
}

}  // namespace shardkit::comm

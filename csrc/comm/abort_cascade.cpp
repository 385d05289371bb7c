#include "comm/abort_cascade.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "comm/engine.h"

namespace shardkit::comm {

namespace {

// Held while an engine is aborted: leave() (from a group's destruction) waits for an abort in progress to finish
// with it. Engine::abort never calls back into the cascade.
std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<Engine*>& registry() {
  static std::vector<Engine*> engines;
  return engines;
}

}  // namespace

void AbortCascade::join(Engine* engine) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(engine);
}

void AbortCascade::leave(Engine* engine) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& engines = registry();
  engines.erase(std::remove(engines.begin(), engines.end(), engine), engines.end());
}

void AbortCascade::abort_others(const Engine* failed, const std::string& reason) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (Engine* engine : registry()) {
    if (engine != failed) engine->abort(reason);
  }
}

}  // namespace shardkit::comm

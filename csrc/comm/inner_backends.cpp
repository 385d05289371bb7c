#include "comm/inner_backends.h"

#include <vector>

namespace shardkit::comm {

c10::intrusive_ptr<c10d::Backend> InnerBackends::get(const c10::intrusive_ptr<c10d::Backend>& backend,
                                                     const char* what, const std::string& where) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(closed_.empty(), where, "group was aborted earlier: ", closed_);
  TORCH_CHECK(backend, where, "this op needs ", what, ", which this group lacks");
  return backend;
}

c10::intrusive_ptr<c10d::Backend> InnerBackends::all_ranks(const std::string& where) {
  return get(all_ranks_, "the inner gloo backend over all ranks", where);
}

c10::intrusive_ptr<c10d::Backend> InnerBackends::leaders(const std::string& where) {
  return get(leaders_, "the host leaders' gloo backend", where);
}

bool InnerBackends::has_leaders() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(leaders_);
}

void InnerBackends::close(const std::string& reason) {
  c10::intrusive_ptr<c10d::Backend> all_ranks, leaders;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!closed_.empty()) return;
    closed_ = reason.empty() ? "closed" : reason;
    all_ranks = std::move(all_ranks_);
    leaders = std::move(leaders_);
  }
  // Destroyed here, outside the lock, unless an op still holds one: then by that op when it ends (its work done,
  // the destructor's join is quick), or never if the op abandons it.
}

void InnerBackends::abandon(c10::intrusive_ptr<c10d::Backend> backend) {
  if (!backend) return;
  // Never destroyed, on purpose (see the header), nor is the list: a worker may abandon one while the process exits.
  static auto* mutex = new std::mutex;
  static auto* graveyard = new std::vector<c10::intrusive_ptr<c10d::Backend>>;
  std::lock_guard<std::mutex> lock(*mutex);
  graveyard->push_back(std::move(backend));
}

void InnerBackends::shutdown() {
  c10::intrusive_ptr<c10d::Backend> all_ranks, leaders;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    all_ranks = std::move(all_ranks_);
    leaders = std::move(leaders_);
    if (closed_.empty()) closed_ = "the process group was shut down (destroy_process_group)";
  }
  if (all_ranks) all_ranks->shutdown();
  if (leaders) leaders->shutdown();
}

}  // namespace shardkit::comm

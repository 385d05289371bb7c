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

c10::intrusive_ptr<c10d::Backend> InnerBackends::inter_host(const std::string& where) {
  return get(inter_host_, "the inter-host gloo backend (this rank's rail)", where);
}

bool InnerBackends::has_inter_host() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(inter_host_);
}

void InnerBackends::close(const std::string& reason) {
  c10::intrusive_ptr<c10d::Backend> all_ranks, inter_host;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!closed_.empty()) return;
    closed_ = reason.empty() ? "closed" : reason;
    all_ranks = std::move(all_ranks_);
    inter_host = std::move(inter_host_);
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
  c10::intrusive_ptr<c10d::Backend> all_ranks, inter_host;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    all_ranks = std::move(all_ranks_);
    inter_host = std::move(inter_host_);
    if (closed_.empty()) closed_ = "the process group was shut down (destroy_process_group)";
  }
  if (all_ranks) all_ranks->shutdown();
  if (inter_host) inter_host->shutdown();
}

}  // namespace shardkit::comm

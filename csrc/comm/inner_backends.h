// InnerBackends: the gloo backends a shardkit group keeps for what its shared memory cannot reach:
//   - `all_ranks`: gloo over every rank of the group (point-to-point; across hosts, the collectives that
//     gain nothing from a hierarchy: gather, scatter, all-to-all);
//   - `leaders`: gloo among the first rank of each host (the inter-host step of hierarchical collectives);
//     null on one host and on ranks that lead no host.
// They are owned here and nowhere else, so that close() really destroys them: destroying a gloo backend
// closes its connections, and every peer blocked on one of them fails at once ("Connection closed by
// peer") instead of waiting out its timeout. That is how an abort on one host reaches the others.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <mutex>
#include <string>

namespace shardkit::comm {

class InnerBackends {
 public:
  InnerBackends(c10::intrusive_ptr<c10d::Backend> all_ranks, c10::intrusive_ptr<c10d::Backend> leaders)
      : all_ranks_(std::move(all_ranks)), leaders_(std::move(leaders)) {}

  // The backend, held by the caller for the duration of one op. Throws `where` + the reason when the
  // backend was closed, or never existed (`what` names it then).
  c10::intrusive_ptr<c10d::Backend> all_ranks(const std::string& where);
  c10::intrusive_ptr<c10d::Backend> leaders(const std::string& where);
  bool has_leaders();

  // Drops both backends (destroyed in the background once no op holds them any more: the caller never waits for
  // an op in flight); later calls fail with `reason`. Idempotent: the first reason stands.
  void close(const std::string& reason);
  // destroy_process_group(): shuts both down and drops them.
  void shutdown();

 private:
  c10::intrusive_ptr<c10d::Backend> get(const c10::intrusive_ptr<c10d::Backend>& backend, const char* what,
                                        const std::string& where);

  std::mutex mutex_;
  c10::intrusive_ptr<c10d::Backend> all_ranks_;
  c10::intrusive_ptr<c10d::Backend> leaders_;
  std::string closed_;  // why they were dropped; empty while open
};

}  // namespace shardkit::comm

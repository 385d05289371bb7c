// InnerBackends: the gloo backends a shardkit group keeps for what its shared memory cannot reach:
//   - `all_ranks`: gloo over every rank of the group (point-to-point; across hosts, the collectives that
//     gain nothing from a hierarchy: gather, scatter, all-to-all);
//   - `inter_host`: this rank's rail, gloo among the ranks at its local position on every host (the inter-host steps
//     of hierarchical collectives). Local rank 0's rail is the host leaders' group, which every group across hosts
//     has; the other local ranks have one only where the group uses rails (hierarchical_engine.h). Null on one host.
// They are owned here, so that close() can destroy them: destroying a gloo backend with no op in flight closes its
// connections, and every peer blocked on one of them fails at once ("Connection closed by peer") instead of
// waiting out its timeout — one way an abort on one host reaches the others (the Store notice is the other:
// failure_notices.h).
//
// An op holds its backend while it runs. A gloo backend cannot cancel an op, and its destructor joins the threads
// running them: an op this rank gives up on while it is in flight (an abort from another thread, a notice from the
// Store) must never drop the last reference, or the thread that drops it waits until that op ends or times out. Such
// a backend is abandoned: kept, never destroyed, for the rest of the process (its connections stay open; peers learn
// of the abort from the Store notice).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <mutex>
#include <string>

namespace shardkit::comm {

class InnerBackends {
 public:
  InnerBackends(c10::intrusive_ptr<c10d::Backend> all_ranks, c10::intrusive_ptr<c10d::Backend> inter_host)
      : all_ranks_(std::move(all_ranks)), inter_host_(std::move(inter_host)) {}

  // The backend, held by the caller for the duration of one op. Throws `where` + the reason when the
  // backend was closed, or never existed (`what` names it then).
  c10::intrusive_ptr<c10d::Backend> all_ranks(const std::string& where);
  c10::intrusive_ptr<c10d::Backend> inter_host(const std::string& where);
  bool has_inter_host();

  // Drops both backends (destroyed here, or by the op that holds one when it ends; an op given up on abandons its
  // own); later calls fail with `reason`. Idempotent: the first reason stands.
  void close(const std::string& reason);
  // Keeps `backend` alive for the rest of the process: the caller gave up on an op that may still run on it.
  static void abandon(c10::intrusive_ptr<c10d::Backend> backend);
  // destroy_process_group(): shuts both down and drops them.
  void shutdown();

 private:
  c10::intrusive_ptr<c10d::Backend> get(const c10::intrusive_ptr<c10d::Backend>& backend, const char* what,
                                        const std::string& where);

  std::mutex mutex_;
  c10::intrusive_ptr<c10d::Backend> all_ranks_;
  c10::intrusive_ptr<c10d::Backend> inter_host_;
  std::string closed_;  // why they were dropped; empty while open
};

}  // namespace shardkit::comm

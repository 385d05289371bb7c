// HierarchicalEngine: the Engine of a group whose ranks sit on several hosts.
//
// Each host's ranks share one core::ShmGroup (local ranks in global-rank order; local rank 0 is the host's
// "leader"); the leaders share a gloo backend (InnerBackends::leaders, leader of host h is its rank h).
// Hosts need not hold equal numbers of ranks, nor consecutive ones.
//
//   allreduce        shm reduce to the leader -> leaders allreduce -> shm broadcast from the leader
//   broadcast        root's host: shm broadcast from root -> leaders broadcast from root's host -> other
//                    hosts: shm broadcast from the leader
//   reduce           shm reduce to the leader -> leaders reduce to root's host -> root's host: shm broadcast
//                    from the leader (only when root is not the leader)
//   allgather        shm gather to the leader -> leaders all-gather host blocks (padded to the largest
//                    host) -> the leader puts every rank's block in place -> shm broadcast of the output
//   reduce_scatter   shm reduce of the whole input to the leader -> leaders allreduce (gloo's own
//                    reduce-scatter is an allreduce too) -> shm scatter of the host's blocks
//   barrier          shm barrier -> leaders barrier -> shm barrier
//   gather, scatter, alltoall: gloo over all ranks (a hierarchy saves nothing on CPU), as raw bytes, so
//                    uneven all-to-all works and gloo's dtype coverage does not matter.
// Every host runs the same sequence of shm ops for a given collective, so the shm agreement check still
// holds inside each host. Between hosts gloo checks nothing (different sizes pair silently, or wait): before
// every op's inter-host steps on a group that compares identities (OpContext::compare_across_hosts: FSDP and DDP
// turn it on for their groups; it is the same on every rank for a given op, so every leader exchanges alike) the
// leaders all-gather a fixed-size fingerprint (number, kind, dtype, count, collective identity: core/
// collective_identity.h, name) and compare it: ranks in different ops, or moving different parts of a model, fail
// there, naming both. It costs one small gloo all-gather among the leaders per op, issued as the op begins and
// waited for just before its first inter-host step, so it overlaps the op's step inside the host.
//
// Failure. Any step failing (a local peer died or disagreed, a gloo error, a timeout) aborts the whole
// group, on every host, within about the time the first rank takes to notice:
//   1. the reason is published in the group's Store (failure_notices.h; first writer wins: later failures
//      report it as the root cause). A rank whose gloo connection was closed first waits up to a second for the
//      closer's reason — the group's notice, or a death of one of its ranks recorded by any group of the job —
//      and, hearing none, names the ranks of the hosts that went silent (none of their ranks reported);
//   2. this host's shm group is aborted, waking every local rank that waits in it;
//   3. the gloo backends are closed (InnerBackends::close), which closes their connections: each peer
//      blocked on one (another host's leader, mid inter-host step) fails at once, and goes through 1-3 itself.
// A leader waiting on gloo also looks at the group's notice every kNoticeEvery, so a host whose ranks failed
// without closing their connections (a process that lingers) still ends the wait. abort() does 1-3 from any
// thread (the process's abort cascade, abort_cascade.h). Messages name the user's op, its number and global ranks.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/engine.h"
#include "comm/failure_notices.h"
#include "comm/inner_backends.h"

namespace shardkit::comm {

// Where a group's ranks sit. Hosts are numbered by their lowest rank; local ranks in global-rank order.
struct HostLayout {
  std::vector<int> host_of;   // host_of[r]: host of group rank r
  std::vector<int> local_of;  // local_of[r]: r's local rank on its host

  int num_hosts() const;
  // The group ranks of host h, in local order.
  std::vector<int> ranks_of(int host) const;
};

class HierarchicalEngine : public Engine {
 public:
  // `local` spans this host's ranks (its rank_names are their global ranks); `inner` holds the leaders'
  // backend on leaders; `notices` is the group's (the backend owns it).
  HierarchicalEngine(int rank, int size, HostLayout layout, std::unique_ptr<core::ShmGroup> local,
                     std::shared_ptr<InnerBackends> inner, std::shared_ptr<FailureNotices> notices);

  void barrier(const OpContext& op) override;
  void broadcast(const OpContext& op, at::Tensor& data, int root) override;
  void allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) override;
  void reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) override;
  void allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) override;
  void gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                      core::ReduceOp reduce) override;
  void alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                at::Tensor& output, const std::vector<size_t>& recv_counts) override;
  void abort(const std::string& reason) override;
  std::vector<std::pair<int, int32_t>> take_exited_peers() override { return local_->take_exited_peers(); }

 private:
  // The op as the leaders compare it (Fingerprint in the .cpp): what the engine's op is and counts.
  struct LeaderStep {
    core::OpKind kind;
    size_t count;
    core::DType dtype;
  };
  // Runs one collective's steps, after the leaders' agreement check where `step` is given (the ops with
  // inter-host steps among leaders) and due; on any failure aborts the group everywhere (see the header) and
  // throws.
  template <typename Steps>
  void guarded(const OpContext& op, std::optional<LeaderStep> step, Steps steps);
  // The leaders' fingerprint exchange (see the header): issued by start_fingerprint; settle_fingerprint waits for it
  // and throws naming both sides where a leader's differs (nothing if none is pending). leaders_for(): the leaders'
  // backend for an op's inter-host payload step, once the op's fingerprints agree.
  void start_fingerprint(const OpContext& op, const LeaderStep& step);
  void settle_fingerprint(const OpContext& op);
  // An op that failed with its fingerprint pending: the exchange may still run (its backend is abandoned).
  void abandon_fingerprint();
  c10::intrusive_ptr<c10d::Backend> leaders_for(const OpContext& op);
  // `await_root_cause`: the failure was a gloo connection another rank closed; give that rank's reason a
  // moment to appear in the Store before publishing this one.
  [[noreturn]] void abort_everywhere(const OpContext& op, const std::string& reason, bool await_root_cause);
  // Steps 2 and 3 of the header, once: false if the engine had aborted already (the first reason stands).
  bool abort_here(const std::string& reason);
  // Why the engine aborted; empty while it has not.
  std::string aborted_reason() const;
  bool leader() const { return local_rank_ == 0; }
  // Waits for an inner gloo op running on `backend`; its failure becomes an error naming the user's op and the
  // step. Ends early, with the reason, when the engine is aborted (from another thread) or the group's notice
  // appears in the Store; the op may then still run, so `backend` is abandoned (InnerBackends::abandon).
  void wait_inner(const OpContext& op, const char* step, c10::intrusive_ptr<c10d::Backend>& backend,
                  const c10::intrusive_ptr<c10d::Work>& work);
  // The leaders' allreduce of `data` with `reduce` (bool data travels as bytes, with an equivalent op).
  void leaders_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce);

  int rank_;
  int size_;
  HostLayout layout_;
  int host_;
  int local_rank_;
  std::vector<std::vector<int>> hosts_;  // hosts_[h]: the group ranks of host h, in local order
  int max_local_size_;                   // ranks on the fullest host
  std::unique_ptr<core::ShmGroup> local_;
  std::shared_ptr<InnerBackends> inner_;
  std::shared_ptr<FailureNotices> notices_;
  // What the host leaders compare before an op's inter-host steps. Fixed-size, so that leaders in different ops
  // still pair this exchange (whatever their payloads' sizes, which gloo would pair silently or wait on), and no
  // implicit padding (compared with memcmp).
  struct Fingerprint {
    uint64_t seq = 0;       // the op's number in the group
    uint64_t identity = 0;  // the part of a model it moves
    uint64_t count = 0;     // elements, as the engine's op counts them
    uint32_t kind = 0;      // core::OpKind
    uint32_t dtype = 0;     // core::DType
    char label[24] = {};    // the user's collective

    std::string describe() const;  // "all_gather_into_tensor #5 (f32 x 528) for FSDP unit 'head_a' (...)"
  };
  static_assert(std::has_unique_object_representations_v<Fingerprint>, "Fingerprint must have no implicit padding");
  struct PendingFingerprint {
    Fingerprint mine;
    c10::intrusive_ptr<c10d::Backend> backend;  // held by the exchange (see wait_inner)
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::optional<PendingFingerprint> fingerprint_;  // the running op's, until settled (worker thread only)
  // The exchange's buffers, made at the first (one op at a time; an exchange given up on, which may still write
  // them, leaves the engine aborted: no other starts).
  at::Tensor fingerprint_in_;
  at::Tensor fingerprint_everyone_;  // every leader's, in host order
  mutable std::mutex abort_mutex_;     // guards aborted_: abort() may come from another group's thread
  std::string aborted_;                // the reason, once this engine has aborted
  std::atomic<bool> is_aborted_{false};
};

}  // namespace shardkit::comm

// HierarchicalEngine: the Engine of a group whose ranks sit on several hosts.
//
// Each host's ranks share one core::ShmGroup (local ranks in global-rank order; local rank 0 is the host's
// "leader"). Across hosts every rank may have a *rail*: gloo among the ranks at its local position on every host
// (InnerBackends::inter_host, rank h on host h). Rail 0, the leaders' group, always exists; the others where the group
// uses rails (Config::rails: hosts hold equal numbers of consecutive ranks, two or more each). Hosts need not hold
// equal numbers of ranks, nor consecutive ones, for the leader scheme.
//
// The leader scheme (ops under kRailMinBytes, groups without rails, and every other collective):
//   allreduce        shm reduce to the leader -> leaders allreduce -> shm broadcast from the leader
//   broadcast        root's host: shm broadcast from root -> leaders broadcast from root's host -> other
//                    hosts: shm broadcast from the leader
//   reduce           shm reduce to the leader -> leaders reduce to root's host -> root's host: shm broadcast
//                    from the leader (only when root is not the leader)
//   allgather        shm gather to the leader -> leaders all-gather host blocks (padded to the largest
//                    host) -> the leader puts every rank's block in place -> shm broadcast of the output
//   reduce_scatter   shm reduce of the whole input to the leader -> leaders all-to-all: each host gets every
//                    other host's partial sums of its own ranks' blocks, and sums them in host order -> shm
//                    scatter of the host's blocks. Each host sends (H-1)/H of the input, what the op needs.
//   barrier          shm barrier -> leaders barrier -> shm barrier
//   gather, scatter, alltoall: gloo over all ranks (a hierarchy saves nothing on CPU), as raw bytes, so
//                    uneven all-to-all works and gloo's dtype coverage does not matter.
// Rails (allreduce, allgather, reduce_scatter of kRailMinBytes and more, in a group with rails; H hosts of L ranks):
// every rail moves 1/L of the host's bytes, all at once, so L sockets and L processes' copies share the link
// instead of the leader's one, and the in-host steps run while bytes are on the link.
//   allreduce        in pieces of kRailPieceBytes per rank: shm reduce-scatter of piece p (local rank k gets its
//                    k-th slice) -> the rail's allreduce of the slice, as two exchanges: part j of the slice to
//                    host j, which sums the parts in host order, then each host's sum to every other -> shm
//                    all-gather of piece p. Later pieces' in-host steps run while earlier ones are on the link.
//   reduce_scatter   in pieces of kRailPieceBytes of every block: for each other host h, shm reduce-scatter of
//                    the piece of h's ranks' blocks (local rank k gets this host's partial sum for h's rank k) ->
//                    rail exchange of those partial sums, begun at once, while the shm reduce-scatter of this
//                    host's own blocks runs -> each rank sums its H partial sums in host order. The bytes on the
//                    link are the leader scheme's, from L sockets; later pieces are summed in the host meanwhile.
//   allgather        rail exchange of the input, every piece posted at once (rank k of each host gets rank k of
//                    every other host's), while this host's shm all-gather runs -> shm all-gather of each other
//                    host's piece into place as it arrives.
// Quantized (OpContext::quantization, core/quantize.h: a wrapper's opt-in): only the inter-host bytes of floating
// data change; each step above sends block-quantized records instead of values and decodes them on arrival.
//   allgather        each rank's input is quantized once, on its own (rails: per piece; leaders: the leader quantizes
//                    each of its ranks' blocks), and every rank holds the decoded values of every input — its own
//                    host's too — so all ranks hold the same bits (what a replica's forward must see).
//   reduce_scatter   the partial sums a host sends are quantized; this host's own partial sum stays exact.
//   reduce           the other hosts' leaders send their partial sums as records to root's host's leader, which
//                    sums them in host order (gloo's reduce has no room for records).
//   allreduce        sums only: both exchanges carry records (the summing rank also keeps the decoded sum, so every
//                    rank ends with the same bits); the leader scheme runs the rails' two-exchange pipeline on the
//                    leaders' rail instead of gloo's allreduce.
// Min / max / product and non-floating data stay exact.
// Both schemes give every rank bitwise identical allreduce results (each element is reduced by one rank once).
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
//
// Point-to-point exchanges (the rails, every reduce-scatter between hosts, every quantized step) are waited for by
// one thread the engine owns (ExchangeWaiter, hierarchical_internal.h, which also maps the engine's files); shutdown()
// and the destructor wake it, even from a wait on a dead peer, and join it.
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

class ExchangeWaiter;  // hierarchical_internal.h

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
  // `local` spans this host's ranks (its rank_names are their global ranks); `inner` holds this rank's rail (on
  // every rank with `rails`, else on leaders); `notices` is the group's (the backend owns it). `rails` is the same
  // on every rank, and only set where hosts hold equal numbers (2+) of consecutive ranks.
  HierarchicalEngine(int rank, int size, HostLayout layout, bool rails, std::unique_ptr<core::ShmGroup> local,
                     std::shared_ptr<InnerBackends> inner, std::shared_ptr<FailureNotices> notices);
  // Both stop and join the exchange thread (see ExchangeWaiter); an exchange still in flight fails.
  ~HierarchicalEngine() override;
  void shutdown() override;

  // Ops of at least this many bytes (the allreduce's data, the all-gather's output, the reduce-scatter's input) use
  // the rails where the group has them: below it, one inter-host step among leaders costs less than L at once.
  static constexpr size_t kRailMinBytes = size_t{256} << 10;
  // The allreduce's pipeline: each rank's slice of one piece (the last may be smaller).
  static constexpr size_t kRailPieceBytes = size_t{2} << 20;

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
  uint64_t inter_host_bytes() const override { return inter_host_bytes_.load(std::memory_order_relaxed); }

 private:
  // The op as the leaders compare it (Fingerprint below, hierarchical_fingerprint.cpp): what the engine's op is and
  // counts.
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
  // and throws naming both sides where a leader's differs (nothing if none is pending). inter_host_for(): this
  // rank's rail for an op's inter-host payload step, once the op's fingerprints agree (on a leader; the other rails
  // wait for the leader in the op's next in-host step, so a disagreement aborts them there, or while they wait).
  void start_fingerprint(const OpContext& op, const LeaderStep& step);
  void settle_fingerprint(const OpContext& op);
  // An op that failed with its fingerprint pending: the exchange may still run (its backend is abandoned).
  void abandon_fingerprint();
  c10::intrusive_ptr<c10d::Backend> inter_host_for(const OpContext& op);
  // `await_root_cause`: the failure was a gloo connection another rank closed; give that rank's reason a
  // moment to appear in the Store before publishing this one.
  [[noreturn]] void abort_everywhere(const OpContext& op, const std::string& reason, bool await_root_cause);
  // Steps 2 and 3 of the header, once: false if the engine had aborted already (the first reason stands).
  bool abort_here(const std::string& reason);
  // Why the engine aborted; empty while it has not.
  std::string aborted_reason() const;
  bool leader() const { return local_rank_ == 0; }
  // Host `host`'s blocks of `block` elements in a tensor laid out by group rank: one run, as its ranks are
  // consecutive (the rails' condition).
  at::Tensor host_run(const at::Tensor& flat, int host, int64_t block) const;
  // Waits for an inner gloo op running on `backend`; its failure becomes an error naming the user's op and the
  // step. Ends early, with the reason, when the engine is aborted (from another thread) or the group's notice
  // appears in the Store; the op may then still run, so `backend` is abandoned (InnerBackends::abandon).
  void wait_inner(const OpContext& op, const char* step, c10::intrusive_ptr<c10d::Backend>& backend,
                  const c10::intrusive_ptr<c10d::Work>& work);
  // Starts the allreduce of `data` with `reduce` on `backend` (bool data travels as bytes, with an equivalent op).
  static c10::intrusive_ptr<c10d::Work> start_allreduce(const OpContext& op, c10d::Backend& backend, at::Tensor& data,
                                                       core::ReduceOp reduce);
  // Starts an exchange on `backend`, this rank's inter-host backend, in which it sends to_peer[i] to the rank of its
  // i-th other host and receives from_peer[i] from it (hosts in order, this one skipped; contiguous tensors, as bytes;
  // an undefined one: nothing that way).
  // Point to point, every transfer at once: gloo's all-to-all moves one direction at a time (half the link's rate,
  // measured). Exchanges in flight together on the same backend need tags of their own. The engine's exchange thread
  // waits for them (exchanges_); the caller waits for the exchange in posting order.
  c10::intrusive_ptr<c10d::Work> start_exchange(const OpContext& op, c10d::Backend& backend,
                                               const std::vector<at::Tensor>& to_peer,
                                               const std::vector<at::Tensor>& from_peer, int tag = 0);
  // The leader scheme of each op, and the rails' (see the header).
  bool use_rails(size_t bytes) const { return rails_ && bytes >= kRailMinBytes; }
  void leaders_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce);
  // The rails' allreduce (`in_host_steps`: every rank of the host, on its rail), or, without the in-host steps, the
  // same pipeline of two exchanges on the leaders' rail over a leader's partial sum (the leader scheme's quantized
  // allreduce: gloo's allreduce has no room for records).
  void pipelined_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, bool in_host_steps);
  void leaders_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output);
  void rails_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output);
  void leaders_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, core::ReduceOp reduce);
  void rails_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, core::ReduceOp reduce);

  int rank_;
  int size_;
  HostLayout layout_;
  int host_;
  int local_rank_;
  std::vector<std::vector<int>> hosts_;  // hosts_[h]: the group ranks of host h, in local order
  int max_local_size_;                   // ranks on the fullest host
  bool rails_;                           // every rank has its rail (see the header)
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
    uint32_t gather_wire = 0;  // OpContext::quantization, each format as bits | block << 8 (0: exact)
    uint32_t reduce_wire = 0;
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
  std::atomic<uint64_t> inter_host_bytes_{0};  // sent in exchanges (inter_host_bytes())
  // The thread waiting for start_exchange's exchanges. Last: stopped and joined before the rest goes.
  std::unique_ptr<ExchangeWaiter> exchanges_;
};

}  // namespace shardkit::comm

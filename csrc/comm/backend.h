// ProcessGroupShardkit: the "shardkit" torch.distributed backend (set-up and teardown: backend_setup.cpp).
//
// Every collective goes the same way: validated once on the calling thread (TensorArgs: errors name the
// rank, the op and the offending value), numbered (OpContext: the group's collective count, the op's own
// deadline), turned into calls on contiguous tensors, and queued on one worker thread in issue order
// (WorkQueue), where the one routing point, route(), hands it to an Engine (engine.h):
//   - one host:     ShmEngine, shared memory between the host's ranks;
//   - several hosts: HierarchicalEngine, shared memory inside each host, gloo among the hosts' leaders.
// The Work completes its Future with the output tensors (what DDP's comm hooks expect) or the error. Every op is
// recorded in the group's flight recorder (TraceRing, trace.h) as it is issued, starts and ends; a failure writes
// the process's recorders to this rank's trace file and names it in the error.
//
// Point-to-point send/recv go to the inner gloo backend over all ranks (InnerBackends), except large messages
// between two ranks of one host, which the receiver reads from the sender's memory (LocalPointToPoint,
// local_p2p.h); monitoredBarrier goes to gloo too. Hosts are told apart by the
// Python creator (python/shardkit/_startup.py), which also builds the inner gloo backends.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/engine.h"
#include "comm/failure_notices.h"
#include "comm/inner_backends.h"
#include "comm/local_p2p.h"
#include "comm/tensor_args.h"
#include "comm/trace.h"
#include "comm/work_queue.h"

namespace shardkit::comm {

#ifdef SHARDKIT_WITH_CUDA
class CudaRoute;
struct CudaReady;
#endif

class ProcessGroupShardkit : public c10d::Backend {
 public:
  struct Config {
    std::string shm_name;  // agreed through the Store by the Python creator (python/shardkit/_startup.py)
    size_t slot_bytes = size_t{1} << 20;
    int processes_on_machine = 0;  // see core::ShmGroup::Options (the creator passes LOCAL_WORLD_SIZE)
    std::chrono::milliseconds timeout{kBackendDefaultTimeout};
    int local_rank = 0;  // this rank's place among the ranks of its host
    int local_size = 1;  // ranks on this host (== size on one host)
    int num_hosts = 1;
    int host_index = 0;          // hosts numbered by their lowest rank
    std::vector<int> host_of;    // host_of[r]: host index of group rank r
    std::vector<int> local_of;   // local_of[r]: local rank of group rank r on its host
    std::vector<int> global_ranks;  // global_ranks[r]: the job's rank of group rank r (how messages name it)
    std::vector<int32_t> pids;      // pids[r]: the process of group rank r (exchanged at start-up)
    // Across hosts: every rank has a rail (`inter_host` below) and large ops use them (hierarchical_engine.h). The
    // creator sets it the same on every rank, only where hosts hold equal numbers of consecutive ranks.
    bool rails = false;
    // A group whose failures stay its own: it neither joins the process's abort cascade (abort_cascade.h: its
    // failure aborts no other group, another group's failure does not abort it) nor records deaths in the job's
    // Store (the `job_store` given to the constructor is ignored; failure_notices.h then uses the group's own).
    // For a group whose failure the job survives: torchft's cross-replica group
    // (python/shardkit/integrations/torchft.py), where a replica that dies is replaced while the replica groups of
    // the others, shardkit groups of the same processes, go on. False: today's behaviour, every group's failure ends
    // the process's others.
    bool isolated = false;
    // Point-to-point messages of at least this many bytes between ranks of one host take the direct route
    // (local_p2p.h; SHARDKIT_P2P_DIRECT_BYTES), which reads the sender's memory unless `p2p_direct_read` is false
    // (SHARDKIT_P2P_DIRECT_READ=0: the bytes then come over gloo after the descriptor).
    size_t p2p_direct_bytes = size_t{2} << 20;
    bool p2p_direct_read = true;
  };

  // Blocks until every local rank has mapped the shared segment; a local peer that exits meanwhile, a failure of
  // the start-up elsewhere (the Store notice) or the timeout ends the wait with an error naming the rank.
  // `store` is the group's Store (failure notices, failure_notices.h); `job_store` the world group's, where
  // deaths are recorded for every group to read (null, or an isolated group: the group's own); `fallback` is gloo over all ranks;
  // `inter_host` this rank's rail, gloo among the ranks at its local position on every host (ranked by host): set on
  // each host's local rank 0 (the leaders' group) when num_hosts > 1, on every rank with `rails`, null otherwise.
  ProcessGroupShardkit(int rank, int size, const Config& config, c10::intrusive_ptr<c10d::Store> store,
                       c10::intrusive_ptr<c10d::Store> job_store, c10::intrusive_ptr<c10d::Backend> fallback,
                       c10::intrusive_ptr<c10d::Backend> inter_host);
  ~ProcessGroupShardkit() override;

  const std::string getBackendName() const override { return "shardkit"; }
  // destroy_process_group(): finishes queued work, stops the worker thread and the inner gloo backends.
  // Idempotent. Also run by python/shardkit/backend.py's exit hook for groups nobody destroyed: the worker must not
  // outlive the interpreter (a thread that touches Python while it finalizes is ended mid-destructor, and the process
  // aborts: "terminate called without an active exception").
  void shutdown() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  // Ends the group now, from any thread: the op in flight and every later one fail with `reason` (on this host's
  // other ranks too: the shared segment's abort flag; other hosts learn through closed connections and the Store
  // notice), and so do point-to-point sends and receives still waiting. The process's other groups are not
  // touched. Idempotent: the first reason stands. shutdown() is still needed to end the group's threads.
  void abort_with(const std::string& reason);
  // c10d's abort (ProcessGroup.abort()): abort_with a reason naming this rank.
  void abort() override;
  // The first failure of one of this group's ops (its error message), or nullopt while none failed: what an
  // owner that survives a failure (torchft's Manager, through errored()) asks after the fact.
  std::optional<std::string> first_failure() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  // gloo's monitored barrier over all ranks (it names the ranks that did not arrive); not queued.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks = false) override;
  // The group's collective count (what OpContext::seq numbers): equal on every rank that issued the same
  // collectives. torch's DETAIL debug mode compares it across ranks.
  void setSequenceNumberForGroup() override { seq_ = 0; }  // at creation, before any op
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  // A synchronous allreduce of one CPU tensor on the calling thread, without a Work or a Future: the fast path
  // behind shardkit.all_reduce_() (python/shardkit/_direct_allreduce.py) for latency-bound callers. Same
  // validation, numbering, order and errors as allreduce(); it waits for ops queued before it.
  void allreduce_now(at::Tensor& tensor, const c10d::ReduceOp& reduce_op, std::chrono::milliseconds timeout);
  // Collective (every rank, same size, in the same place among the group's ops): `bytes` of host memory, as a
  // uint8 tensor, that the group's ranks map from one another (Engine::share_buffer). An allreduce of a tensor
  // lying in it (a view of it, dtype and shape free) runs in place from the peers' buffers, and a reduce-scatter
  // whose input lies in it reads the peers' inputs there, without the copies through the group's slots; results
  // are the same bits as elsewhere. Undefined where the group's engine has no shared memory (ranks on several
  // hosts), or, with the reason in `*refused` (if given), where /dev/shm has not the room: every rank gets the
  // same answer. Nothing is logged here: the Python caller warns (shardkit.backend.shared_buffer). Ordered behind
  // queued ops.
  at::Tensor shared_buffer(int64_t bytes, std::string* refused = nullptr);
  // Collectives that read their input from a shared buffer on this group (for tests and benchmarks).
  uint64_t shared_ops() const { return engine_->shared_ops(); }
  // Payload bytes this rank has received by reading a peer's memory (point-to-point's direct route, local_p2p.h).
  uint64_t direct_p2p_bytes() const { return local_p2p_->direct_bytes_received(); }
  // Payload bytes this rank has sent to other hosts in exchanges (Engine::inter_host_bytes).
  uint64_t inter_host_bytes() const { return engine_->inter_host_bytes(); }

  // What carries this group's CUDA collectives: "nccl", "host shared memory: <why>", "undecided: ..." before
  // the first one, or why there is no CUDA support in this build.
  std::string cuda_route() const;
  // From the next op on, every op compares its collective identity (core/collective_identity.h) across hosts too:
  // the host leaders exchange a fingerprint before its inter-host steps (hierarchical_engine.h). Inside a host the
  // shm op header compares it always. Every rank turns it on at the same point among the group's ops (FSDP and DDP
  // do, at construction); idempotent. Nothing changes on one host.
  void compare_identities_across_hosts() { compare_across_hosts_.store(true); }
  // Where deaths are recorded for the whole job (the world group's Store; failure_notices.h): what this group's
  // subgroups are given.
  c10::intrusive_ptr<c10d::Store> job_store() const { return notices_->job_store(); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Numbers the op, queues `body(engine, op)` (run on the worker thread) and returns its Work, whose
  // Future yields `outputs`. A synchronous caller (`async_op=False`, opts.asyncOp) may run it inline when
  // nothing is pending. `inputs`: tensors the op reads besides `outputs` where outputs alone may not show the
  // device (gather's input on a non-root rank). An op on CUDA tensors runs after what the caller's current
  // stream queued before it; its Work completes once the op is queued on the device, and its wait() makes the
  // caller's stream (not the host) wait for it; the CUDA watchdog follows it to its end (comm/nccl/cuda_route.h).
  // `traced_inputs`: the op's inputs as its flight-recorder entry shows them (empty: `inputs`, else the outputs,
  // for in-place ops).
  template <typename OpOptions, typename Body>
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* profiling_title, const char* op,
                                        std::vector<at::Tensor> outputs, const OpOptions& opts, Body body,
                                        const std::vector<at::Tensor>& inputs = {},
                                        const std::vector<at::Tensor>& traced_inputs = {});
  // The routing point for host tensors: the engine topology chose when the group was built. Ops on CUDA
  // tensors go to cuda_ instead, which picks NCCL or host staging (comm/nccl/cuda_route.h).
  Engine& route(const OpContext& op);
  // What carries the group's ops, held weakly: the abort cascade keeps a copy, which must not keep them alive.
  struct Routes {
    std::weak_ptr<Engine> host;
#ifdef SHARDKIT_WITH_CUDA
    std::weak_ptr<CudaRoute> cuda;
#endif
    // Aborts each route that still exists (idempotent: the first reason stands).
    void abort(const std::string& reason) const;
  };
  Routes routes() const;
  // Runs one op's body and marks its flight-recorder entry (`ticket`) ended; if it fails, records the deaths it saw
  // for the job, aborts this group (peers waiting in it fail now) and the process's other shardkit groups
  // (abort_cascade.h; not where Config::isolated), writes this rank's trace (the group's first failure only),
  // keeps the first failure's message (first_failure()), then rethrows, the error naming the trace file.
  template <typename Body>
  void run_failing_everywhere(uint64_t ticket, Body&& body);
  // After a failure: writes the trace if this group has not yet, and returns what the error adds about it.
  std::string trace_after_failure(const std::string& message);
  // The op as it runs: numbered in run order, named by the global rank, with the identity it was issued under and
  // whether the group compared identities across hosts then.
  OpContext context(const char* op, std::chrono::milliseconds timeout, uint64_t identity, bool compare_across_hosts,
                    core::InterHostQuantization quantization);
  std::chrono::milliseconds op_timeout(std::chrono::milliseconds requested) const;
  // A point-to-point op's Work, remembered (weakly) so that abort_with() can end it while it waits.
  c10::intrusive_ptr<c10d::Work> track_point_to_point(c10::intrusive_ptr<c10d::Work> work);
  void refuse_cuda_point_to_point(const std::vector<at::Tensor>& tensors, const char* op) const;
  // allreduce of a sparse COO tensor (SUM only, like gloo's): every rank's indices and values, gathered.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse_coo(const at::Tensor& tensor, const c10d::AllreduceOptions& opts);

  core::PeerNames ranks_;  // the group's ranks as messages name them (global ranks) and their pids
  TensorArgs args_;
  Config config_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<InnerBackends> inner_;
  std::shared_ptr<FailureNotices> notices_;
  // Shared with the abort cascade's function for this group, which holds them weakly.
  std::shared_ptr<Engine> engine_;
#ifdef SHARDKIT_WITH_CUDA
  std::shared_ptr<CudaRoute> cuda_;  // ops on CUDA tensors (comm/nccl/cuda_route.h)
#endif
  uint64_t cascade_token_ = 0;  // this group's place in the abort cascade (abort_cascade.h)
  std::atomic<bool> compare_across_hosts_{false};
  std::atomic<uint64_t> seq_{0};       // collectives issued on this group (torch's sequence number)
  std::atomic<uint64_t> executed_{0};  // collectives started, in the order ops run (OpContext::seq)
  std::atomic<bool> shut_down_{false};
  std::shared_ptr<TraceRing> trace_;  // this group's flight recorder (registered with TraceRegistry)
  mutable std::mutex failure_mutex_;
  std::optional<std::string> first_failure_;  // under failure_mutex_
  std::shared_ptr<TrackedWorks> point_to_point_ = std::make_shared<TrackedWorks>();  // what abort_with() ends
  std::shared_ptr<LocalPointToPoint> local_p2p_;  // large sends and receives between ranks of one host
  WorkQueue queue_;  // last: destroyed first, so queued work finishes while the engine still exists
};

}  // namespace shardkit::comm

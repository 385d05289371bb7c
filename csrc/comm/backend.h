// ProcessGroupShardkit: the "shardkit" torch.distributed backend.
//
// A c10d::Backend whose collectives on CPU tensors run through core::ShmGroup (shared memory between the
// ranks of this host), each queued on one worker thread in issue order and completed through a Future
// that yields the output tensors. Point-to-point send/recv go through an inner gloo backend over the same
// ranks (`fallback`), the existing engine.
//
// Several hosts: ranks are grouped by host (the Python creator decides, see backend.py). The shm group
// then spans this host's ranks only, and allreduce, broadcast and barrier run hierarchically: within the
// host through shared memory, between hosts through `inter_host` (gloo among each host's first rank, the
// "leaders"). The other collectives gain nothing from a hierarchy on CPU and go to `fallback` whole.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "comm/tensor_args.h"
#include "comm/work_queue.h"
#include "core/shm_group.h"

namespace shardkit::comm {

class ProcessGroupShardkit : public c10d::Backend {
 public:
  struct Config {
    std::string shm_name;  // agreed through the Store by the Python creator (python/shardkit/backend.py)
    size_t slot_bytes = size_t{1} << 20;
    std::chrono::milliseconds timeout{kBackendDefaultTimeout};
    int local_rank = 0;  // this rank's place among the ranks of its host
    int local_size = 1;  // ranks on this host (== size on one host)
    int num_hosts = 1;
    int host_index = 0;          // hosts numbered by their lowest rank
    std::vector<int> host_of;    // host_of[r]: host index of global rank r
    std::vector<int> local_of;   // local_of[r]: local rank of global rank r on its host
  };

  // Blocks until every local rank has mapped the shared segment (or the timeout passes). `inter_host` is
  // the leaders' gloo group: set on each host's local rank 0 when num_hosts > 1, null otherwise.
  ProcessGroupShardkit(int rank, int size, const Config& config, c10::intrusive_ptr<c10d::Backend> fallback,
                       c10::intrusive_ptr<c10d::Backend> inter_host);
  ~ProcessGroupShardkit() override;

  const std::string getBackendName() const override { return "shardkit"; }
  // destroy_process_group(): finishes queued work, stops the worker thread and the inner gloo backends.
  void shutdown() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
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
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Queues `body` (run on the worker thread with the op's timeout) and returns its Work, whose Future
  // yields `outputs`.
  // A synchronous caller (`async_op=False`, opts.asyncOp) may run it inline when nothing is pending.
  template <typename OpOptions>
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                                        const OpOptions& opts, std::function<void()> body);
  std::chrono::milliseconds op_timeout(std::chrono::milliseconds requested) const;
  // In-place reduction of a contiguous tensor over the group (allreduce, or reduce when root >= 0).
  void reduce_tensor(at::Tensor& tensor, core::DType dtype, const ReduceSpec& spec, int root);
  // Broadcast of a contiguous tensor from global rank `root`, hierarchical across hosts.
  void broadcast_tensor(at::Tensor& tensor, core::DType dtype, int root);
  bool multi_host() const { return config_.num_hosts > 1; }
  // Throws (naming the op) when this group spans hosts and no fallback engine exists.
  c10d::Backend& fallback(const char* op);

  TensorArgs args_;
  Config config_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<core::ShmGroup> group_;  // this host's ranks
  c10::intrusive_ptr<c10d::Backend> fallback_;
  c10::intrusive_ptr<c10d::Backend> inter_host_;
  WorkQueue queue_;  // last: destroyed first, so queued work finishes while the group still exists
};

}  // namespace shardkit::comm

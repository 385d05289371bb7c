// HostStagedEngine: CUDA tensors through a host engine (device -> host -> shared memory -> device).
//
// The route for CUDA tensors where NCCL cannot serve the group (two or more ranks on one GPU, which NCCL
// refuses; or NCCL could not be set up), and for the reductions NCCL lacks (NcclEngine hands those over op by
// op). Slow and correct: each call copies its CUDA inputs to host memory, runs the wrapped engine on the
// copies, and copies what the op wrote back to the device, each copy on the current stream and waited for.
// CudaRoute has made that stream wait for the caller's, so the inputs are final when they are read; when a
// call returns, its outputs are on the device. CPU tensors pass straight through.
#pragma once

#include "comm/engine.h"

namespace shardkit::comm {

class HostStagedEngine final : public Engine {
 public:
  explicit HostStagedEngine(Engine& host) : host_(host) {}

  void barrier(const OpContext& op) override { host_.barrier(op); }
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
  // The host engine's: staging is a way of using it.
  void abort(const std::string& reason) override { host_.abort(reason); }
  std::vector<std::pair<int, int32_t>> take_exited_peers() override { return host_.take_exited_peers(); }

 private:
  Engine& host_;  // the group's shared-memory or hierarchical engine; the backend owns it
};

}  // namespace shardkit::comm

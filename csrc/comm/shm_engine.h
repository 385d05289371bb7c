// ShmEngine: the Engine of a group whose ranks all share one host: every collective is one core::ShmGroup op
// on the group's shared-memory segment (csrc/core/shm_group.h has the protocol). A failure aborts the
// segment, which every local rank's waits check, so all ranks learn of it at once.
#pragma once

#include <memory>

#include "comm/engine.h"

namespace shardkit::comm {

class ShmEngine : public Engine {
 public:
  explicit ShmEngine(std::unique_ptr<core::ShmGroup> group) : group_(std::move(group)) {}

  void barrier(const OpContext& op) override;
  void broadcast(const OpContext& op, at::Tensor& data, int root) override;
  void allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) override;
  void allreduce_average(const OpContext& op, at::Tensor& data, int64_t divisor) override;
  void reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) override;
  void allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) override;
  void gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                      core::ReduceOp reduce) override;
  void alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                at::Tensor& output, const std::vector<size_t>& recv_counts) override;
  std::shared_ptr<core::SharedBuffer> share_buffer(const OpContext& op, size_t bytes, std::string* refused) override;
  uint64_t shared_ops() const override { return group_->shared_ops(); }
  void abort(const std::string& reason) override { group_->abort(reason); }
  std::vector<std::pair<int, int32_t>> take_exited_peers() override { return group_->take_exited_peers(); }

 private:
  std::unique_ptr<core::ShmGroup> group_;
};

// Element offsets of blocks packed back to back with the given counts.
std::vector<size_t> packed_offsets(const std::vector<size_t>& counts);

}  // namespace shardkit::comm

#include "comm/nccl/host_staged_engine.h"

namespace shardkit::comm {

namespace {

// A host image of one tensor argument. `read`: the engine reads it (copied in); write_back() copies what the
// engine wrote to the device. CPU and undefined tensors are used as they are.
class Staged {
 public:
  Staged(const at::Tensor& tensor, bool read) : device_(tensor) {
    if (!tensor.defined() || !tensor.is_cuda()) {
      host = tensor;
      return;
    }
    host = read ? tensor.to(at::kCPU) : at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  }
  void write_back() {
    if (device_.defined() && device_.is_cuda()) device_.copy_(host);  // synchronous: pageable host memory
  }

  at::Tensor host;

 private:
  at::Tensor device_;
};

}  // namespace

void HostStagedEngine::broadcast(const OpContext& op, at::Tensor& data, int root) {
  Staged d(data, op.rank == root);
  host_.broadcast(op, d.host, root);
  if (op.rank != root) d.write_back();
}

void HostStagedEngine::allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  Staged d(data, true);
  host_.allreduce(op, d.host, reduce);
  d.write_back();
}

void HostStagedEngine::reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) {
  Staged d(data, true);
  host_.reduce(op, d.host, reduce, root);
  if (op.rank == root) d.write_back();
}

void HostStagedEngine::allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  Staged in(input, true), out(output, false);
  host_.allgather(op, in.host, out.host);
  out.write_back();
}

void HostStagedEngine::gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  Staged in(input, true), out(output, false);
  host_.gather(op, in.host, out.host, root);
  if (op.rank == root) out.write_back();
}

void HostStagedEngine::scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  Staged in(input, op.rank == root), out(output, false);
  host_.scatter(op, in.host, out.host, root);
  out.write_back();
}

void HostStagedEngine::reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                      core::ReduceOp reduce) {
  Staged in(input, true), out(output, false);
  host_.reduce_scatter(op, in.host, out.host, reduce);
  out.write_back();
}

void HostStagedEngine::alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                                at::Tensor& output, const std::vector<size_t>& recv_counts) {
  Staged in(input, true), out(output, false);
  host_.alltoall(op, in.host, send_counts, out.host, recv_counts);
  out.write_back();
}

}  // namespace shardkit::comm

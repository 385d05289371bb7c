#include "comm/shm_engine.h"

namespace shardkit::comm {

namespace {
void* data_or_null(const at::Tensor& tensor) { return tensor.defined() ? tensor.data_ptr() : nullptr; }
}  // namespace

std::vector<size_t> packed_offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
  return offsets;
}

void ShmEngine::barrier(const OpContext& op) { group_->barrier(op.call()); }

void ShmEngine::broadcast(const OpContext& op, at::Tensor& data, int root) {
  group_->broadcast(data.data_ptr(), numel_of(data), core_dtype(data), root, op.call());
}

void ShmEngine::allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  group_->allreduce(data.data_ptr(), data.data_ptr(), numel_of(data), core_dtype(data), reduce, op.call());
}

void ShmEngine::allreduce_average(const OpContext& op, at::Tensor& data, int64_t divisor) {
  group_->allreduce_average(data.data_ptr(), data.data_ptr(), numel_of(data), core_dtype(data), divisor, op.call());
}

void ShmEngine::reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) {
  // The engine writes only root's out; a non-root's `data` is read, never written.
  group_->reduce(data.data_ptr(), data.data_ptr(), numel_of(data), core_dtype(data), reduce, root, op.call());
}

void ShmEngine::allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  group_->allgather(input.data_ptr(), output.data_ptr(), numel_of(input), core_dtype(input), op.call());
}

void ShmEngine::gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  group_->gather(input.data_ptr(), data_or_null(output), numel_of(input), core_dtype(input), root, op.call());
}

void ShmEngine::scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  group_->scatter(data_or_null(input), output.data_ptr(), numel_of(output), core_dtype(output), root, op.call());
}

void ShmEngine::reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                               core::ReduceOp reduce) {
  group_->reduce_scatter(input.data_ptr(), output.data_ptr(), numel_of(output), core_dtype(output), reduce,
                         op.call());
}

void ShmEngine::alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                         at::Tensor& output, const std::vector<size_t>& recv_counts) {
  group_->alltoall(input.data_ptr(), send_counts, packed_offsets(send_counts), output.data_ptr(), recv_counts,
                   packed_offsets(recv_counts), core_dtype(input), op.call());
}

std::shared_ptr<core::SharedBuffer> ShmEngine::share_buffer(const OpContext& op, size_t bytes, std::string* refused) {
  return group_->share_buffer(bytes, op.call(), refused);
}

}  // namespace shardkit::comm

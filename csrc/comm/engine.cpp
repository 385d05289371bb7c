#include "comm/engine.h"

#include "core/reduce.h"

namespace shardkit::comm {

void Engine::allreduce_average(const OpContext& op, at::Tensor& data, int64_t divisor) {
  allreduce(op, data, core::ReduceOp::Sum);
  core::divide_in_place(data.data_ptr(), static_cast<size_t>(data.numel()), core_dtype(data), divisor);
}

}  // namespace shardkit::comm

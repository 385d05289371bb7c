#include "comm/engine.h"

#include <c10/util/Exception.h>

#include "core/reduce.h"

namespace shardkit::comm {

void Engine::allreduce_average(const OpContext& op, at::Tensor& data, int64_t divisor) {
  allreduce(op, data, core::ReduceOp::Sum);
  core::divide_in_place(data.data_ptr(), numel_of(data), core_dtype(data), divisor);
}

at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

std::string message_of(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

}  // namespace shardkit::comm

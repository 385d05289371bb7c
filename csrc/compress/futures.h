// Future plumbing shared by the compression hooks: every hook returns a Future<Tensor> at once and does
// the rest of its work in callbacks, on whichever thread completes the collective it waits for (the
// backend's worker), so the autograd thread never blocks on a wait.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <exception>
#include <utility>
#include <vector>

namespace shardkit::compress {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// The Future a hook returns: it will hold `like`'s result tensor (devices from `like`, for CUDA streams).
inline FuturePtr tensor_future(const at::Tensor& like) {
  std::vector<c10::Device> devices;
  if (!like.device().is_cpu()) devices.push_back(like.device());
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), std::move(devices));
}

// Sum-allreduce `tensor` in place over `group`; the Future completes when it is done.
inline FuturePtr allreduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor) {
  std::vector<at::Tensor> payload{tensor};
  return group->allreduce(payload)->getFuture();
}

// When `done` completes, runs `step()` on the completing thread. An error of `done`, or one `step` throws,
// completes `result` with that error, so a failed collective reaches the reducer instead of hanging it.
template <typename Step>
void then_run(const FuturePtr& done, const FuturePtr& result, Step step) {
  done->addCallback([result, step = std::move(step)](c10::ivalue::Future& finished) mutable {
    if (finished.hasError()) {
      result->setErrorIfNeeded(finished.exception_ptr());
      return;
    }
    try {
      step();
    } catch (...) {
      result->setErrorIfNeeded(std::current_exception());
    }
  });
}

// torch's default averaging allreduce (default_hooks.allreduce_hook): divide, sum, hand `buffer` back.
inline FuturePtr allreduce_average(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor buffer) {
  buffer.div_(group->getSize());
  FuturePtr result = tensor_future(buffer);
  then_run(allreduce_sum(group, buffer), result, [result, buffer] { result->markCompleted(c10::IValue(buffer)); });
  return result;
}

}  // namespace shardkit::compress

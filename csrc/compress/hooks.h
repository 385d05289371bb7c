// shardkit's native DDP comm hooks and the adapter that installs them into a reducer (torch's
// c10d::Reducer or shardkit's), so that no Python runs per bucket.
//
// Hook kinds: "powersgd" and "batched_powersgd" (a PowerSGDState), "fp16" and "bf16" (a process group:
// cast the bucket, divide by the world size, allreduce, cast back into the bucket — torch's
// fp16_compress_hook / bf16_compress_hook).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <functional>
#include <memory>
#include <string>

#include "compress/futures.h"
#include "compress/powersgd.h"

namespace shardkit::compress {

// torch's fp16/bf16_compress_hook: `dtype` is at::kHalf or at::kBFloat16.
FuturePtr cast_compress_hook(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10d::GradBucket& bucket,
                             at::ScalarType dtype);

// A comm hook implemented in C++: the reducer calls `run` per bucket; the Future holds the result tensor.
class NativeCommHook : public c10d::CommHookInterface {
 public:
  using Run = std::function<FuturePtr(c10d::GradBucket&)>;
  NativeCommHook(std::string name, Run run) : name_(std::move(name)), run_(std::move(run)) {}
  FuturePtr runHook(c10d::GradBucket& bucket) override { return run_(bucket); }
  at::Tensor parseHookResult(const c10::IValue& result) override;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  Run run_;
};

// The hook of `kind` ("powersgd", "batched_powersgd", "fp16", "bf16"). PowerSGD kinds need `state`;
// the cast kinds use `group`. An unknown kind or a missing argument is an error naming it.
std::unique_ptr<NativeCommHook> make_native_hook(const std::string& kind, std::shared_ptr<PowerSGDState> state,
                                                 c10::intrusive_ptr<c10d::ProcessGroup> group);

}  // namespace shardkit::compress

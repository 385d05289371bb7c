// HostOffload: the device half of FSDP's parameter offloading (CPUOffload(offload_params=True)) for one
// FlatParamHandle (csrc/fsdp/flat_param.h says when the handle calls it).
//
// The handle's shard (the master parameters) and the gradients it hands out live in pinned host memory; the
// full buffer, the flat gradient and every collective are on the compute device. This class owns what moves
// values between the two without stalling the compute stream ("compute stream" below: the caller's current
// stream on the device, whichever thread calls):
//
//   copy-in (unshard)   compute ──record──> before_in ──wait──> copy-in stream: H2D copy of the shard into its
//                       slice of the full buffer (in the shard's dtype: a DMA from pinned memory, no CPU pass;
//                       into a device staging buffer first when param_dtype differs, then cast on the device),
//                       record copied_in, then the caller's all-gather is issued while the copy-in stream is
//                       current (shardkit's backend, like NCCL's, orders a CUDA collective after the caller's
//                       current stream at issue, so the gather reads the copied slice). The copy-in stream
//                       waits for the compute stream first because the full buffer's memory came from the
//                       caching allocator on the compute stream: earlier compute work may still use it.
//   use                 the compute stream waits for copied_in (order_after_copy_in; the all-gather's own wait
//                       covers the other ranks' slices).
//   settle              before the host may write the shard again (reshard, write-back, destruction) it waits
//                       for copied_in (settle_copy_in; by then the copy is normally long done).
//   gradient ready      reduce_start records grad_ready on the compute stream once the flat gradient (and its
//                       cast into the reduce dtype) is queued there: all the copy-out needs from the compute
//                       stream, so it never waits for backward work queued after it.
//   copy-out (reduce)   copy-out stream ──wait──> grad_ready; then, with the copy-out stream current, the
//                       caller's wait for the collectives (a backend whose Work::wait() orders the current stream
//                       after the collective, as NCCL's does, orders the copy-out stream; shardkit's returns once
//                       the collective is complete on the device); then the 1/N a full-precision sum still owes
//                       and the cast to the parameters' dtype, the D2H copy into a fresh pinned host tensor, and
//                       copied_out. The host waits for copied_out before copy_out() returns, because the CPU
//                       optimizer reads the gradient straight from host memory, which no stream orders.
//
// Lifetimes without recordStream: the full buffer is allocated on the compute stream and freed (reshard) only
// after the compute stream waited for the copy-in and the host settled it; the staging buffers are allocated
// while their side stream is current, so the allocator hands their blocks out again only to later work on that
// same stream, after the copy that used them; the reduced device gradient (allocated on the compute stream,
// divided and read on the copy-out stream) is held by the caller until copy_out() has waited for copied_out.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>

namespace shardkit::fsdp {

class HostOffload {
 public:
  // `device`: the compute device (a CUDA device with an index). `where`: the owner's message prefix (rank,
  // unit). Throws, naming the feature and the reason, where it cannot work: a CPU build of shardkit, a device
  // that is not CUDA or does not exist.
  HostOffload(at::Device device, std::string where);
  ~HostOffload();  // settles a copy-in still in flight (it reads the shard and writes the full buffer)
  HostOffload(const HostOffload&) = delete;
  HostOffload& operator=(const HostOffload&) = delete;

  const at::Device& device() const { return device_; }

  // Queues the copy-in of `shard` (host, pinned) into `dst` (on the device, contiguous, the same numel, any
  // dtype: cast on the device), then calls `issue` with the copy-in stream current. No host wait.
  void copy_in(at::Tensor& dst, const at::Tensor& shard, const std::function<void()>& issue);
  // The caller's current stream waits for the last copy-in (no host wait).
  void order_after_copy_in() const;
  // The host waits for the last copy-in if it has not yet; the shard may be written afterwards.
  void settle_copy_in();
  // Records grad_ready on the caller's current stream: the flat gradient of the reduction just issued is final
  // there. Once per reduction, before copy_out.
  void gradient_ready();
  // `reduced` (on the device, contiguous; divided in place when it already has `dtype`) divided by `divisor` and
  // cast to `dtype`, as a new pinned host tensor; returns once its values are there. `wait` (the collectives'
  // waits) runs first, with the copy-out stream current. `reduced` must be held until this returns.
  at::Tensor copy_out(const at::Tensor& reduced, int64_t divisor, at::ScalarType dtype,
                      const std::function<void()>& wait);

 private:
  struct Streams;  // the side streams and events (CUDA build; csrc/fsdp/offload.cpp)
  at::Device device_;
  std::string where_;
  std::unique_ptr<Streams> streams_;
};

}  // namespace shardkit::fsdp

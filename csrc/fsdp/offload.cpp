#include "fsdp/offload.h"

#include <ATen/core/grad_mode.h>

#include <utility>

#include "fsdp/cast.h"

#ifdef SHARDKIT_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace shardkit::fsdp {

#ifdef SHARDKIT_WITH_CUDA

struct HostOffload::Streams {
  explicit Streams(const at::Device& device)
      : copy_in(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        copy_out(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  c10::cuda::CUDAStream copy_in;   // H2D copies of the shard (and their casts)
  c10::cuda::CUDAStream copy_out;  // casts and D2H copies of reduced gradients
  c10::Event before_in{c10::DeviceType::CUDA};   // on the compute stream, before a copy-in
  c10::Event copied_in{c10::DeviceType::CUDA};   // on the copy-in stream, after it
  c10::Event grad_ready{c10::DeviceType::CUDA};  // on the compute stream, once a flat gradient is final
  c10::Event copied_out{c10::DeviceType::CUDA};  // on the copy-out stream, after it
  bool copy_in_unsettled = false;                // copied_in recorded, the host has not waited for it
};

HostOffload::HostOffload(at::Device device, std::string where) : device_(device), where_(std::move(where)) {
  TORCH_CHECK(device_.is_cuda() && device_.has_index(), where_,
              "offload_params=True computes on a CUDA device with an index; got ", device_);
  const int count = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(device_.index() < count, where_, "offload_params=True: the compute device ", device_,
              " does not exist (", count, " CUDA device", count == 1 ? "" : "s", " visible)");
  streams_ = std::make_unique<Streams>(device_);
}

HostOffload::~HostOffload() {
  try {
    settle_copy_in();
  } catch (...) {  // a destructor must not throw; a failed device is reported by whatever uses it next
  }
}

void HostOffload::copy_in(at::Tensor& dst, const at::Tensor& shard, const std::function<void()>& issue) {
  TORCH_INTERNAL_ASSERT(dst.device() == device_ && shard.is_cpu() && dst.numel() == shard.numel(),
                        "HostOffload::copy_in: expected a host shard and a device slice of as many elements");
  Streams& s = *streams_;
  const c10::cuda::CUDAGuard device_guard(device_);
  s.before_in.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  s.before_in.block(s.copy_in);
  const c10::cuda::CUDAStreamGuard on_copy_in(s.copy_in);
  at::NoGradGuard no_grad;
  if (dst.scalar_type() == shard.scalar_type()) {
    dst.copy_(shard, /*non_blocking=*/true);
  } else {
    // ATen would cast on the CPU first (a pass over the shard and a pageable copy); copy the shard's own
    // bytes instead and cast on the device. `staging` is allocated on the copy-in stream (current): its block
    // goes back to that stream's pool here, reused only by later copy-in work, which runs after this cast.
    at::Tensor staging = at::empty(shard.sizes(), at::TensorOptions().dtype(shard.scalar_type()).device(device_));
    staging.copy_(shard, /*non_blocking=*/true);
    cast_into(dst, staging, 1, where_);
  }
  s.copied_in.record(s.copy_in);
  s.copy_in_unsettled = true;
  issue();
}

void HostOffload::order_after_copy_in() const {
  streams_->copied_in.block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

void HostOffload::settle_copy_in() {
  if (!streams_ || !streams_->copy_in_unsettled) return;
  streams_->copied_in.synchronize();
  streams_->copy_in_unsettled = false;
}

void HostOffload::gradient_ready() {
  streams_->grad_ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
}

at::Tensor HostOffload::copy_out(const at::Tensor& reduced, int64_t divisor, at::ScalarType dtype,
                                 const std::function<void()>& wait) {
  TORCH_INTERNAL_ASSERT(reduced.device() == device_ && reduced.is_contiguous(),
                        "HostOffload::copy_out: expected a contiguous tensor on the compute device");
  Streams& s = *streams_;
  const c10::cuda::CUDAGuard device_guard(device_);
  at::Tensor host = at::empty(reduced.sizes(), at::TensorOptions().dtype(dtype).pinned_memory(true));
  at::Tensor source;  // held (as `reduced` is by the caller) until the host has waited below
  {
    const c10::cuda::CUDAStreamGuard on_copy_out(s.copy_out);
    s.grad_ready.block(s.copy_out);
    wait();
    at::NoGradGuard no_grad;
    // On the copy-out stream: a cast's output is allocated there (its block is reused only by later copy-out
    // work); an in-place divide writes `reduced`, which nothing else uses any more.
    source = divide_as(reduced, divisor, dtype, where_);
    host.copy_(source, /*non_blocking=*/true);
    s.copied_out.record(s.copy_out);
  }
  s.copied_out.synchronize();  // the CPU optimizer reads `host` as soon as this returns
  return host;
}

#else  // a CPU build: the feature is refused by name, never silently run on the host

struct HostOffload::Streams {};

HostOffload::HostOffload(at::Device device, std::string where) : device_(device), where_(std::move(where)) {
  TORCH_CHECK(false, where_, "offload_params=True needs a CUDA device to compute on (", device_,
              " was asked for), but this shardkit was built without CUDA (build it with SHARDKIT_CUDA=1)");
}

HostOffload::~HostOffload() = default;

void HostOffload::copy_in(at::Tensor&, const at::Tensor&, const std::function<void()>&) {
  TORCH_INTERNAL_ASSERT(false, "HostOffload without CUDA");
}

void HostOffload::order_after_copy_in() const { TORCH_INTERNAL_ASSERT(false, "HostOffload without CUDA"); }

void HostOffload::settle_copy_in() {}

void HostOffload::gradient_ready() { TORCH_INTERNAL_ASSERT(false, "HostOffload without CUDA"); }

at::Tensor HostOffload::copy_out(const at::Tensor&, int64_t, at::ScalarType, const std::function<void()>&) {
  TORCH_INTERNAL_ASSERT(false, "HostOffload without CUDA");
}

#endif

}  // namespace shardkit::fsdp

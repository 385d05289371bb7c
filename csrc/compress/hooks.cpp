#include "compress/hooks.h"
#include "profile_span.h"
#ifdef SHARDKIT_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace shardkit::compress {

FuturePtr cast_compress_hook(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10d::GradBucket& bucket,
                             at::ScalarType dtype) {
  SHARDKIT_PROFILE_SPAN(std::string("shardkit::") + (dtype == at::kBFloat16 ? "bf16" : "fp16") + "_compress[" +
                        std::to_string(bucket.getIndex()) + "]");
  at::Tensor buffer = bucket.getBuffer();
  TORCH_CHECK(at::isFloatingType(buffer.scalar_type()), "shardkit ", dtype, " compress hook (rank ",
              group->getRank(), "): bucket ", bucket.getIndex(), " holds ", buffer.scalar_type(),
              ", not floating-point gradients");
  const bool fused = buffer.is_cuda() && buffer.is_contiguous();
  at::Tensor compressed;
#ifdef SHARDKIT_WITH_CUDA
  if (fused) {  // cast and 1/N in one pass, rounded once (torch rounds after the cast and after the division)
    compressed = at::empty(buffer.sizes(), buffer.options().dtype(dtype));
    cuda::cast_scale_(compressed, buffer, 1.0 / group->getSize());
  }
#endif
  if (!compressed.defined()) compressed = buffer.to(dtype).div_(group->getSize());
  FuturePtr result = tensor_future(buffer);
  then_run(allreduce_sum(group, compressed), result, [result, buffer, compressed, fused] {
    at::Tensor out = buffer;
#ifdef SHARDKIT_WITH_CUDA
    if (fused) {
      cuda::cast_scale_(out, compressed, 1.0);
      result->markCompleted(c10::IValue(out));
      return;
    }
#endif
    out.copy_(compressed);  // decompress in place: no second full-precision buffer
    result->markCompleted(c10::IValue(out));
  });
  return result;
}

at::Tensor NativeCommHook::parseHookResult(const c10::IValue& result) {
  if (result.isTensor()) return result.toTensor();
  TORCH_INTERNAL_ASSERT(result.isTensorList(), "comm hook ", name_, " returned neither a Tensor nor a TensorList");
  return result.toTensorVector().at(0);
}

std::unique_ptr<NativeCommHook> make_native_hook(const std::string& kind, std::shared_ptr<PowerSGDState> state,
                                                 c10::intrusive_ptr<c10d::ProcessGroup> group) {
  if (kind == "powersgd" || kind == "batched_powersgd") {
    TORCH_CHECK(state != nullptr, "shardkit.hooks.register: kind \"", kind, "\" needs a PowerSGDState, got None");
    if (kind == "powersgd") {
      return std::make_unique<NativeCommHook>(kind, [state](c10d::GradBucket& b) { return state->powersgd_hook(b); });
    }
    return std::make_unique<NativeCommHook>(kind,
                                            [state](c10d::GradBucket& b) { return state->batched_powersgd_hook(b); });
  }
  if (kind == "fp16" || kind == "bf16") {
    TORCH_CHECK(group, "shardkit.hooks.register: kind \"", kind, "\" needs a process group");
    const at::ScalarType dtype = kind == "fp16" ? at::kHalf : at::kBFloat16;
    return std::make_unique<NativeCommHook>(
        kind, [group, dtype](c10d::GradBucket& b) { return cast_compress_hook(group, b, dtype); });
  }
  TORCH_CHECK(false, "shardkit.hooks.register: unknown hook kind \"", kind,
              "\"; expected \"powersgd\", \"batched_powersgd\", \"fp16\" or \"bf16\"");
}

}  // namespace shardkit::compress

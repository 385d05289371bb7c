#include "fsdp/cast.h"

#include <string>

#ifdef SHARDKIT_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace shardkit::fsdp {

namespace {

#ifdef SHARDKIT_WITH_CUDA
bool kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

// The cast_scale kernel takes it: both on one CUDA device, contiguous, dtypes it knows.
bool fused(const at::Tensor& dst, const at::Tensor& src) {
  return dst.is_cuda() && src.is_cuda() && dst.device() == src.device() && dst.is_contiguous() &&
         src.is_contiguous() && kernel_dtype(dst.scalar_type()) && kernel_dtype(src.scalar_type());
}
#endif

}  // namespace

void cast_into(at::Tensor& dst, const at::Tensor& src, int64_t divisor, const std::string& where) {
  TORCH_CHECK(divisor >= 1, where, "cast: the divisor must be at least 1, got ", divisor);
  TORCH_CHECK(dst.numel() == src.numel(), where, "cast: the destination has ", dst.numel(), " elements, the source ",
              src.numel());
  TORCH_CHECK(dst.device() == src.device(), where, "cast: the destination is on ", dst.device(), ", the source on ",
              src.device(), " (cross-device copies are the offload's, not a cast)");
  if (divisor == 1 && dst.scalar_type() == src.scalar_type()) {
    if (!dst.is_same(src)) dst.copy_(src);
    return;
  }
#ifdef SHARDKIT_WITH_CUDA
  if (fused(dst, src)) {
    cuda::cast_scale_(dst, src, 1.0 / static_cast<double>(divisor));
    return;
  }
#endif
  if (divisor == 1) {
    dst.copy_(src);
  } else {
    at::div_out(dst, src, at::scalar_tensor(divisor, src.options()));
  }
}

at::Tensor divide_as(at::Tensor src, int64_t divisor, at::ScalarType dtype, const std::string& where) {
  if (src.scalar_type() == dtype) {
    if (divisor > 1) src.div_(divisor);
    return src;
  }
  at::Tensor dst = at::empty({src.numel()}, src.options().dtype(dtype)).view(src.sizes());
  cast_into(dst, src, divisor, where);
  return dst;
}

}  // namespace shardkit::fsdp

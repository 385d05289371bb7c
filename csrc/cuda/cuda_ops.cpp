#include "cuda/cuda_ops.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/kernels.h"

namespace shardkit::cuda {

void scale_(at::Tensor& tensor, double factor) {
  TORCH_CHECK(tensor.is_cuda(), "shardkit cuda_scale_: expected a CUDA tensor, got one on ", tensor.device());
  TORCH_CHECK(tensor.is_contiguous(), "shardkit cuda_scale_: expected a contiguous tensor");
  ScaleParams params;
  switch (tensor.scalar_type()) {
    case at::kFloat: params.dtype = KernelDType::F32; break;
    case at::kDouble: params.dtype = KernelDType::F64; break;
    case at::kHalf: params.dtype = KernelDType::F16; break;
    case at::kBFloat16: params.dtype = KernelDType::BF16; break;
    default: TORCH_CHECK(false, "shardkit cuda_scale_: dtype ", tensor.scalar_type(), " is not a floating dtype");
  }
  params.data = tensor.data_ptr();
  params.count = tensor.numel();
  params.factor = factor;
  const c10::cuda::CUDAGuard guard(tensor.device());
  const cudaError_t status = launch_scale(params, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "shardkit cuda_scale_: kernel launch failed: ", cudaGetErrorString(status));
}

}  // namespace shardkit::cuda

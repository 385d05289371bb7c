#include "cuda/cuda_ops.h"

#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <string>

#include "cuda/kernels.h"

namespace shardkit::cuda {
namespace {

KernelDType kernel_dtype(const at::Tensor& tensor, const char* op, const char* what) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return KernelDType::F32;
    case at::kDouble: return KernelDType::F64;
    case at::kHalf: return KernelDType::F16;
    case at::kBFloat16: return KernelDType::BF16;
    default:
      TORCH_CHECK(false, "shardkit ", op, ": ", what, " has dtype ", tensor.scalar_type(),
                  "; expected float32, float64, float16 or bfloat16");
  }
}

void check_device_tensor(const at::Tensor& tensor, const at::Device& device, const char* op, const std::string& what) {
  TORCH_CHECK(tensor.defined(), "shardkit ", op, ": ", what, " is undefined");
  TORCH_CHECK(tensor.device() == device, "shardkit ", op, ": ", what, " is on ", tensor.device(), ", expected ", device);
  TORCH_CHECK(tensor.is_contiguous(), "shardkit ", op, ": ", what, " is not contiguous");
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "shardkit ", op, ": kernel launch failed: ", cudaGetErrorString(status));
}

// pack_ and unpack_: the flat buffer's checks, then launches of up to kMaxPackSegments tensors each.
void move_segments(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
                   bool to_flat, double factor, const char* op) {
  TORCH_CHECK(flat.defined() && flat.is_cuda(), "shardkit ", op, ": the flat buffer must be a CUDA tensor");
  check_device_tensor(flat, flat.device(), op, "the flat buffer");
  TORCH_CHECK(tensors.size() == offsets.size(), "shardkit ", op, ": ", tensors.size(), " tensors but ", offsets.size(),
              " offsets");
  const KernelDType dtype = kernel_dtype(flat, op, "the flat buffer");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensor " + std::to_string(i);
    check_device_tensor(tensors[i], flat.device(), op, what);
    TORCH_CHECK(tensors[i].scalar_type() == flat.scalar_type(), "shardkit ", op, ": ", what, " has dtype ",
                tensors[i].scalar_type(), ", the flat buffer ", flat.scalar_type());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), "shardkit ", op, ": ", what,
                " (", tensors[i].numel(), " elements at offset ", offsets[i], ") does not fit the flat buffer of ",
                flat.numel(), " elements");
  }
  const c10::cuda::CUDAGuard guard(flat.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.device().index());
  PackParams params;
  params.flat = flat.data_ptr();
  params.dtype = dtype;
  params.to_flat = to_flat;
  params.factor = factor;
  for (size_t first = 0; first < tensors.size(); first += kMaxPackSegments) {
    const size_t last = std::min(tensors.size(), first + kMaxPackSegments);
    params.segments = static_cast<int>(last - first);
    for (size_t i = first; i < last; ++i) {
      params.segment[i - first] = PackSegment{tensors[i].data_ptr(), tensors[i].numel(), offsets[i]};
    }
    check_launch(launch_pack(params, stream), op);
  }
}

}  // namespace

void scale_(at::Tensor& tensor, double factor) {
  TORCH_CHECK(tensor.is_cuda(), "shardkit cuda_scale_: expected a CUDA tensor, got one on ", tensor.device());
  check_device_tensor(tensor, tensor.device(), "cuda_scale_", "the tensor");
  ScaleParams params;
  params.dtype = kernel_dtype(tensor, "cuda_scale_", "the tensor");
  params.data = tensor.data_ptr();
  params.count = tensor.numel();
  params.factor = factor;
  const c10::cuda::CUDAGuard guard(tensor.device());
  check_launch(launch_scale(params, c10::cuda::getCurrentCUDAStream(tensor.device().index())), "cuda_scale_");
}

void pack_(at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets) {
  move_segments(flat, tensors, offsets, /*to_flat=*/true, 1.0, "cuda_pack_");
}

void unpack_(const at::Tensor& flat, std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
             double factor) {
  move_segments(flat, tensors, offsets, /*to_flat=*/false, factor, "cuda_unpack_");
}

void cast_scale_(at::Tensor& dst, const at::Tensor& src, double factor) {
  TORCH_CHECK(src.defined() && src.is_cuda(), "shardkit cuda_cast_scale_: src must be a CUDA tensor");
  check_device_tensor(src, src.device(), "cuda_cast_scale_", "src");
  check_device_tensor(dst, src.device(), "cuda_cast_scale_", "dst");
  TORCH_CHECK(dst.numel() == src.numel(), "shardkit cuda_cast_scale_: dst has ", dst.numel(), " elements, src ",
              src.numel());
  CastScaleParams params;
  params.src = src.data_ptr();
  params.dst = dst.data_ptr();
  params.src_dtype = kernel_dtype(src, "cuda_cast_scale_", "src");
  params.dst_dtype = kernel_dtype(dst, "cuda_cast_scale_", "dst");
  if (src.numel() == 0) return;
  // In place is fine element by element when the dtypes are equal; any other overlap would read overwritten data.
  const at::MemOverlapStatus overlap = at::get_overlap_status(dst, src);
  TORCH_CHECK(overlap == at::MemOverlapStatus::No ||
                  (overlap == at::MemOverlapStatus::Full && params.src_dtype == params.dst_dtype),
              "shardkit cuda_cast_scale_: dst overlaps src; only an in-place scale between equal dtypes is allowed");
  params.count = src.numel();
  params.factor = factor;
  const c10::cuda::CUDAGuard guard(src.device());
  check_launch(launch_cast_scale(params, c10::cuda::getCurrentCUDAStream(src.device().index())), "cuda_cast_scale_");
}

void orthogonalize_(at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.defined() && matrices.is_cuda() && matrices.dim() == 3,
              "shardkit cuda_orthogonalize_: expected a 3-D CUDA tensor (batch, rows, cols)");
  check_device_tensor(matrices, matrices.device(), "cuda_orthogonalize_", "the matrices");
  OrthogonalizeParams params;
  params.data = matrices.data_ptr();
  params.dtype = kernel_dtype(matrices, "cuda_orthogonalize_", "the matrices");
  params.batch = matrices.size(0);
  params.rows = matrices.size(1);
  params.cols = matrices.size(2);
  params.epsilon = epsilon;
  const c10::cuda::CUDAGuard guard(matrices.device());
  check_launch(launch_orthogonalize(params, c10::cuda::getCurrentCUDAStream(matrices.device().index())),
               "cuda_orthogonalize_");
}

}  // namespace shardkit::cuda

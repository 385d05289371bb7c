// In-place scaling of a device buffer: the AVG (divide by world size) and PREMUL_SUM (multiply before the
// sum) steps of CUDA collectives. Grid-stride loop; 16-bit types compute in f32 and round once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"

namespace shardkit::cuda {
namespace {

template <typename T>
struct Math {
  __device__ static T scale(T value, float factor) { return static_cast<T>(value * factor); }
};
template <>
struct Math<double> {
  __device__ static double scale(double value, double factor) { return value * factor; }
};
template <>
struct Math<__half> {
  __device__ static __half scale(__half value, float factor) { return __float2half_rn(__half2float(value) * factor); }
};
template <>
struct Math<__nv_bfloat16> {
  __device__ static __nv_bfloat16 scale(__nv_bfloat16 value, float factor) {
    return __float2bfloat16_rn(__bfloat162float(value) * factor);
  }
};

template <typename T, typename F>
__global__ void scale_kernel(T* data, int64_t count, F factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = Math<T>::scale(data[i], factor);
  }
}

template <typename T, typename F>
cudaError_t launch(const ScaleParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (p.count + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
  scale_kernel<T, F><<<grid, kThreads, 0, stream>>>(static_cast<T*>(p.data), p.count, static_cast<F>(p.factor));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_scale(const ScaleParams& params, cudaStream_t stream) {
  switch (params.dtype) {
    case KernelDType::F32: return launch<float, float>(params, stream);
    case KernelDType::F64: return launch<double, double>(params, stream);
    case KernelDType::F16: return launch<__half, float>(params, stream);
    case KernelDType::BF16: return launch<__nv_bfloat16, float>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace shardkit::cuda

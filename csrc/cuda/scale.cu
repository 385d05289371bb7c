// In-place scaling of a device buffer: the AVG (divide by world size) and PREMUL_SUM (multiply before the
// sum) steps of CUDA collectives. Grid-stride loop; 16-bit types compute in f32 and round once.
#include "cuda/device_math.cuh"

namespace shardkit::cuda {
namespace {

template <typename T>
__global__ void scale_kernel(T* data, int64_t count, typename Arith<T>::type factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = Store<T>::from(to_arith(data[i]) * factor);
  }
}

}  // namespace

cudaError_t launch_scale(const ScaleParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.count == 0) return cudaSuccess;
    constexpr int kThreads = 256;
    scale_kernel<T><<<grid_for(p.count, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(p.data), p.count, static_cast<typename Arith<T>::type>(p.factor));
    return cudaGetLastError();
  });
}

}  // namespace shardkit::cuda

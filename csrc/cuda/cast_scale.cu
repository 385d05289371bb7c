// dst = cast(src * factor): mixed precision's casts (fp32 <-> bf16/fp16) fused with the 1/N of an average, and
// the fp16/bf16 compression hooks' casts. Arithmetic in f32 (f64 when either side is f64), rounded once (f64 to
// a 16-bit type: through f32, twice, as torch's own cast).
#include <type_traits>

#include "cuda/device_math.cuh"

namespace shardkit::cuda {
namespace {

template <typename A, typename S, typename D>
__global__ void cast_scale_kernel(const S* src, D* dst, int64_t count, A factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    dst[i] = Store<D>::from(static_cast<A>(to_arith(src[i])) * factor);
  }
}

}  // namespace

cudaError_t launch_cast_scale(const CastScaleParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  if (p.src == p.dst && p.src_dtype != p.dst_dtype) return cudaErrorInvalidValue;
  return dispatch_dtype(p.src_dtype, [&](auto src_tag) {
    return dispatch_dtype(p.dst_dtype, [&](auto dst_tag) {
      using S = decltype(src_tag);
      using D = decltype(dst_tag);
      constexpr bool wide = std::is_same_v<S, double> || std::is_same_v<D, double>;
      using A = std::conditional_t<wide, double, float>;
      constexpr int kThreads = 256;
      cast_scale_kernel<A, S, D><<<grid_for(p.count, kThreads), kThreads, 0, stream>>>(
          static_cast<const S*>(p.src), static_cast<D*>(p.dst), p.count, static_cast<A>(p.factor));
      return cudaGetLastError();
    });
  });
}

}  // namespace shardkit::cuda

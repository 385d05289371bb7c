// dst = cast(src * factor): mixed precision's casts (fp32 <-> bf16/fp16) fused with the 1/N of an average, and
// the fp16/bf16 compression hooks' casts. Arithmetic in f32 (f64 when either side is f64), rounded once (f64 to
// a 16-bit type: through f32, twice, as torch's own cast). 16-byte accesses where src and dst are aligned.
#include <cstdint>
#include <type_traits>

#include "cuda/device_math.cuh"

namespace shardkit::cuda {
namespace {

// One element: widened to A, scaled, rounded once to D. Every kernel below computes exactly this.
template <typename A, typename S, typename D>
__device__ __forceinline__ D cast_scaled(S value, A factor) {
  return Store<D>::from(static_cast<A>(to_arith(value)) * factor);
}

template <typename A, typename S, typename D>
__global__ void cast_scale_kernel(const S* src, D* dst, int64_t count, A factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    dst[i] = cast_scaled<A, S, D>(src[i], factor);
  }
}

// N values of T moved as one aligned access (N * sizeof(T) <= 16 bytes: one vector load or store).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T value[N];
};

// The same values as cast_scale_kernel, N elements per access where src and dst are aligned to their vectors;
// the last count % N elements one by one. src == dst (same dtype, in place) is fine: each thread reads its
// elements before it writes them, and no other thread touches them.
template <typename A, typename S, typename D, int N>
__global__ void cast_scale_vector_kernel(const S* src, D* dst, int64_t count, A factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = count / N;
  const auto* from = reinterpret_cast<const Vector<S, N>*>(src);
  auto* to = reinterpret_cast<Vector<D, N>*>(dst);
  for (int64_t i = first; i < vectors; i += stride) {
    const Vector<S, N> in = from[i];
    Vector<D, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.value[k] = cast_scaled<A, S, D>(in.value[k], factor);
    to[i] = out;
  }
  for (int64_t i = vectors * N + first; i < count; i += stride) {
    dst[i] = cast_scaled<A, S, D>(src[i], factor);
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
      constexpr int kN = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));  // elements per 16-byte access
      const bool vectors_aligned = reinterpret_cast<uintptr_t>(p.src) % (kN * sizeof(S)) == 0 &&
                                   reinterpret_cast<uintptr_t>(p.dst) % (kN * sizeof(D)) == 0;
      if (vectors_aligned) {
        cast_scale_vector_kernel<A, S, D, kN><<<resident_grid_for((p.count + kN - 1) / kN, kThreads), kThreads, 0,
                                                stream>>>(static_cast<const S*>(p.src), static_cast<D*>(p.dst),
                                                          p.count, static_cast<A>(p.factor));
      } else {
        cast_scale_kernel<A, S, D><<<grid_for(p.count, kThreads), kThreads, 0, stream>>>(
            static_cast<const S*>(p.src), static_cast<D*>(p.dst), p.count, static_cast<A>(p.factor));
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace shardkit::cuda

// Device-side helpers shared by shardkit's kernels: the storage type of each KernelDType, the type arithmetic
// runs in (f32 for 16-bit and f32 values, f64 for f64), conversions that round once, a block-wide sum, and
// the dispatch from a KernelDType to a template instantiation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"

namespace shardkit::cuda {

template <typename T> struct Arith { using type = float; };
template <> struct Arith<double> { using type = double; };

__device__ __forceinline__ float to_arith(float v) { return v; }
__device__ __forceinline__ double to_arith(double v) { return v; }
__device__ __forceinline__ float to_arith(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_arith(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> struct Store;
template <> struct Store<float> {
  template <typename A> __device__ static float from(A v) { return static_cast<float>(v); }
};
template <> struct Store<double> {
  template <typename A> __device__ static double from(A v) { return static_cast<double>(v); }
};
template <> struct Store<__half> {
  template <typename A> __device__ static __half from(A v) { return __float2half_rn(static_cast<float>(v)); }
};
template <> struct Store<__nv_bfloat16> {
  template <typename A> __device__ static __nv_bfloat16 from(A v) { return __float2bfloat16_rn(static_cast<float>(v)); }
};

// Sum of `value` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 values of A in shared memory. Ends with a barrier, so it can be called again at once.
template <typename A>
__device__ A block_sum(A value, A* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x / 32);
  A total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];  // the same order on every thread: one result
  __syncthreads();
  return total;
}

// Calls `body(T{})` with T the storage type of `dtype`; cudaErrorInvalidValue for an unknown dtype.
template <typename Body>
cudaError_t dispatch_dtype(KernelDType dtype, Body&& body) {
  switch (dtype) {
    case KernelDType::F32: return body(float{});
    case KernelDType::F64: return body(double{});
    case KernelDType::F16: return body(__half{});
    case KernelDType::BF16: return body(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Blocks for a grid-stride loop over `count` items with `threads` per block.
inline unsigned grid_for(int64_t count, int threads, int64_t max_blocks = 65535) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < max_blocks ? blocks : max_blocks));
}

// Blocks for a grid-stride loop that fill the device once (every multiprocessor at its most resident threads)
// and no more than `count` items need: each thread then runs several steps, without waves of short blocks.
inline unsigned resident_grid_for(int64_t count, int threads) {
  int device = 0, multiprocessors = 0, threads_per_multiprocessor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&threads_per_multiprocessor, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
          cudaSuccess) {
    return grid_for(count, threads);  // the launch that follows reports what is wrong with the device
  }
  return grid_for(count, threads, int64_t{multiprocessors} * (threads_per_multiprocessor / threads));
}

}  // namespace shardkit::cuda

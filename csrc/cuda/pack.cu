// Multi-tensor pack/unpack: up to kMaxPackSegments tensors moved to or from one flat buffer in one launch
// (blockIdx.y picks the tensor, blockIdx.x strides over it). A plain copy moves 16 bytes per access when the
// segment's source, destination and length are all 16-byte aligned (4 bytes when 4-aligned, else single
// bytes); an unpack with a factor other than 1 is a typed, scaled copy (the average fused into the copy-back).
#include "cuda/device_math.cuh"

namespace shardkit::cuda {
namespace {

constexpr int kThreads = 256;

struct Span {
  const char* src;
  char* dst;
  int64_t bytes;
};

__device__ Span span_of(const PackParams& p, int index, int64_t element) {
  const PackSegment& s = p.segment[index];
  char* flat = static_cast<char*>(p.flat) + s.offset * element;
  char* tensor = static_cast<char*>(s.tensor);
  return p.to_flat ? Span{tensor, flat, s.count * element} : Span{flat, tensor, s.count * element};
}

template <typename Word>
__device__ void copy_words(const char* src, char* dst, int64_t words) {
  const Word* from = reinterpret_cast<const Word*>(src);
  Word* to = reinterpret_cast<Word*>(dst);
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) to[i] = from[i];
}

__global__ void copy_kernel(PackParams p, int64_t element) {
  const Span span = span_of(p, static_cast<int>(blockIdx.y), element);
  const auto aligned = [&](uintptr_t to) {
    return (reinterpret_cast<uintptr_t>(span.src) % to == 0) && (reinterpret_cast<uintptr_t>(span.dst) % to == 0);
  };
  if (aligned(16)) {
    const int64_t words = span.bytes / 16;
    copy_words<uint4>(span.src, span.dst, words);
    copy_words<char>(span.src + words * 16, span.dst + words * 16, span.bytes - words * 16);
  } else if (aligned(4)) {
    const int64_t words = span.bytes / 4;
    copy_words<uint32_t>(span.src, span.dst, words);
    copy_words<char>(span.src + words * 4, span.dst + words * 4, span.bytes - words * 4);
  } else {
    copy_words<char>(span.src, span.dst, span.bytes);
  }
}

template <typename T>
__global__ void scaled_unpack_kernel(PackParams p, typename Arith<T>::type factor) {
  const PackSegment& s = p.segment[blockIdx.y];
  const T* from = static_cast<const T*>(p.flat) + s.offset;
  T* to = static_cast<T*>(s.tensor);
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.count; i += stride) {
    to[i] = Store<T>::from(to_arith(from[i]) * factor);
  }
}

}  // namespace

cudaError_t launch_pack(const PackParams& p, cudaStream_t stream) {
  if (p.segments <= 0) return cudaSuccess;
  if (p.segments > kMaxPackSegments || (p.to_flat && p.factor != 1.0)) return cudaErrorInvalidValue;
  const int64_t element = element_bytes(p.dtype);
  int64_t largest = 0;
  for (int i = 0; i < p.segments; ++i) largest = p.segment[i].count > largest ? p.segment[i].count : largest;
  if (largest == 0) return cudaSuccess;
  if (p.factor == 1.0) {
    // 16 bytes per thread and step: enough blocks to cover the largest segment once, capped.
    const dim3 grid(grid_for((largest * element + 15) / 16, kThreads, 1024), static_cast<unsigned>(p.segments));
    copy_kernel<<<grid, kThreads, 0, stream>>>(p, element);
    return cudaGetLastError();
  }
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(grid_for(largest, kThreads, 1024), static_cast<unsigned>(p.segments));
    scaled_unpack_kernel<T><<<grid, kThreads, 0, stream>>>(p, static_cast<typename Arith<T>::type>(p.factor));
    return cudaGetLastError();
  });
}

}  // namespace shardkit::cuda

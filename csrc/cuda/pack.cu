// Multi-tensor pack/unpack: up to kMaxPackSegments tensors moved to or from one flat buffer in one launch.
// A plain copy is cut into chunks of kChunkBytes, one thread block each, numbered across the segments (a block
// finds its segment by a binary search of the chunk map), so no block idles on a short segment and the grid is
// exactly the work. Each thread keeps kWordsPerThread loads in flight before its stores; 16-byte words when a
// segment's source and destination are 16-byte aligned (4-byte words when 4-aligned, else single bytes). An
// unpack with a factor other than 1 is a typed, scaled copy (the average fused into the copy-back).
#include <cstdint>

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

constexpr int kWordsPerThread = 4;
constexpr int64_t kChunkBytes = int64_t{kThreads} * kWordsPerThread * 16;  // 16 KiB: one block's share

// chunk_start[s]: the first chunk of segment s; chunk_start[segments]: the chunk count.
struct ChunkMap {
  int64_t chunk_start[kMaxPackSegments + 1];
};

template <typename Word>
__device__ void copy_chunk(const char* __restrict__ src, char* __restrict__ dst, int64_t bytes) {
  const Word* from = reinterpret_cast<const Word*>(src);
  Word* to = reinterpret_cast<Word*>(dst);
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t base = 0; base < words; base += int64_t{kWordsPerThread} * blockDim.x) {
    Word held[kWordsPerThread];
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u) {  // every load issued before the first store
      const int64_t i = base + int64_t{u} * blockDim.x + threadIdx.x;
      if (i < words) held[u] = from[i];
    }
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u) {
      const int64_t i = base + int64_t{u} * blockDim.x + threadIdx.x;
      if (i < words) to[i] = held[u];
    }
  }
  for (int64_t i = words * static_cast<int64_t>(sizeof(Word)) + threadIdx.x; i < bytes; i += blockDim.x) {
    dst[i] = src[i];
  }
}

__global__ void copy_kernel(PackParams p, ChunkMap map, int64_t element) {
  const int64_t chunk = blockIdx.x;
  int lo = 0, hi = p.segments - 1;  // the last segment whose first chunk is at or before this one
  while (lo < hi) {                  // (an empty segment owns no chunk: the one after it wins the tie)
    const int mid = (lo + hi + 1) / 2;
    if (map.chunk_start[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int segment = lo;
  const Span span = span_of(p, segment, element);
  const int64_t begin = (chunk - map.chunk_start[segment]) * kChunkBytes;  // a chunk keeps its segment's alignment
  const int64_t bytes = span.bytes - begin < kChunkBytes ? span.bytes - begin : kChunkBytes;
  const char* src = span.src + begin;
  char* dst = span.dst + begin;
  const auto aligned = [&](uintptr_t to) {
    return (reinterpret_cast<uintptr_t>(src) % to == 0) && (reinterpret_cast<uintptr_t>(dst) % to == 0);
  };
  if (aligned(16)) {
    copy_chunk<uint4>(src, dst, bytes);
  } else if (aligned(4)) {
    copy_chunk<uint32_t>(src, dst, bytes);
  } else {
    copy_chunk<char>(src, dst, bytes);
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
  if (p.factor == 1.0) {
    ChunkMap map;
    int64_t chunks = 0;
    for (int i = 0; i < p.segments; ++i) {
      map.chunk_start[i] = chunks;
      chunks += (p.segment[i].count * element + kChunkBytes - 1) / kChunkBytes;
    }
    map.chunk_start[p.segments] = chunks;
    if (chunks == 0) return cudaSuccess;
    if (chunks > INT32_MAX) return cudaErrorInvalidValue;  // 32 TiB in one launch
    copy_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(p, map, element);
    return cudaGetLastError();
  }
  int64_t largest = 0;
  for (int i = 0; i < p.segments; ++i) largest = p.segment[i].count > largest ? p.segment[i].count : largest;
  if (largest == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(grid_for(largest, kThreads, 1024), static_cast<unsigned>(p.segments));
    scaled_unpack_kernel<T><<<grid, kThreads, 0, stream>>>(p, static_cast<typename Arith<T>::type>(p.factor));
    return cudaGetLastError();
  });
}

}  // namespace shardkit::cuda

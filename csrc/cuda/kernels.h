// shardkit's CUDA kernels, torch-free: each takes a plain parameter struct and a stream, launches on that
// stream and returns the launch status. Adapters (csrc/cuda/cuda_ops.cpp) validate tensors and fill the structs.
//
// What they promise (checked against torch references by tests/python/test_cuda_kernels.py, on a GPU):
//   - scale: data *= factor in place;
//   - pack / unpack: many tensors <-> one flat buffer in one launch per kMaxPackSegments tensors, 16-byte
//     accesses where a segment's source and destination are 16-byte aligned (4-byte where 4-aligned, else
//     bytes); unpack may scale on the way (the DDP copy-back fused with the 1/N average);
//   - cast_scale: dst = cast(src * factor) between f32, f64, f16 and bf16, computed in f32 (f64 if either side
//     is f64) and rounded once -- except f64 -> f16/bf16, which rounds to f32 first, as torch's casts do;
//     16-byte accesses where src and dst are aligned to them;
//   - orthogonalize: batched Gram-Schmidt on b matrices of n x r (row-major, r small), one thread block per
//     matrix, columns in order: column i divided by its norm (+ epsilon when epsilon != 0), then its projection
//     removed from the columns after it -- torch's PowerSGD _orthogonalize_gram_schmidt, step by step.
// 16-bit values are computed in f32 everywhere. Scaling multiplies by `factor`: an average passes 1/N, which can
// differ from torch's division by N in the last bit where N is not a power of two.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardkit::cuda {

enum class KernelDType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

// Bytes of one element of `dtype`.
inline int64_t element_bytes(KernelDType dtype) {
  switch (dtype) {
    case KernelDType::F32: return 4;
    case KernelDType::F64: return 8;
    case KernelDType::F16:
    case KernelDType::BF16: return 2;
  }
  return 0;
}

struct ScaleParams {
  void* data = nullptr;  // contiguous device buffer
  int64_t count = 0;     // elements
  KernelDType dtype = KernelDType::F32;
  double factor = 1.0;   // data[i] *= factor, computed in f32 for 16-bit types and rounded once
};

cudaError_t launch_scale(const ScaleParams& params, cudaStream_t stream);

// One launch moves up to this many tensors; the struct stays far below the 4 KB kernel-argument limit.
constexpr int kMaxPackSegments = 64;

struct PackSegment {
  void* tensor = nullptr;  // contiguous device memory of one tensor
  int64_t count = 0;       // elements
  int64_t offset = 0;      // element offset of this tensor in the flat buffer
};

struct PackParams {
  void* flat = nullptr;
  KernelDType dtype = KernelDType::F32;  // of the flat buffer and of every tensor
  bool to_flat = true;                   // pack: tensors -> flat; unpack: flat -> tensors
  double factor = 1.0;                   // unpack only: tensor = flat * factor (1: a plain copy)
  int segments = 0;                      // <= kMaxPackSegments
  PackSegment segment[kMaxPackSegments];
};

cudaError_t launch_pack(const PackParams& params, cudaStream_t stream);

struct CastScaleParams {
  const void* src = nullptr;
  void* dst = nullptr;  // may equal src only when both dtypes are the same
  KernelDType src_dtype = KernelDType::F32;
  KernelDType dst_dtype = KernelDType::F32;
  int64_t count = 0;
  double factor = 1.0;
};

cudaError_t launch_cast_scale(const CastScaleParams& params, cudaStream_t stream);

struct OrthogonalizeParams {
  void* data = nullptr;  // b x n x r, contiguous, row-major; orthogonalised in place
  KernelDType dtype = KernelDType::F32;
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  double epsilon = 0.0;
};

cudaError_t launch_orthogonalize(const OrthogonalizeParams& params, cudaStream_t stream);

}  // namespace shardkit::cuda

// shardkit's CUDA kernels, torch-free: each takes a plain parameter struct and a stream.
// Adapters (csrc/cuda/cuda_ops.cpp) validate tensors and fill the structs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardkit::cuda {

enum class KernelDType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

struct ScaleParams {
  void* data = nullptr;  // contiguous device buffer
  int64_t count = 0;     // elements
  KernelDType dtype = KernelDType::F32;
  double factor = 1.0;   // data[i] *= factor, computed in f32 for 16-bit types and rounded once
};

// Launches the in-place scale on `stream`; returns the launch status.
cudaError_t launch_scale(const ScaleParams& params, cudaStream_t stream);

}  // namespace shardkit::cuda

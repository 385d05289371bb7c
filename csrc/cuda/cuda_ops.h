// Torch-facing entry points of shardkit's CUDA code (built only with SHARDKIT_WITH_CUDA).
#pragma once

#include <ATen/ATen.h>

namespace shardkit::cuda {

// tensor *= factor in place, on the current CUDA stream. Floating CUDA tensors only.
void scale_(at::Tensor& tensor, double factor);
// The version of the NCCL library shardkit linked, as NCCL encodes it (e.g. 22805 for 2.28.5).
int nccl_version();

}  // namespace shardkit::cuda

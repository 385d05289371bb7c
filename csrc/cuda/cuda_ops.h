// Torch-facing entry points of shardkit's CUDA code (built only with SHARDKIT_WITH_CUDA). Each validates its
// tensors (CUDA, one device, contiguous, the dtypes it names) with an error naming the op and the offending
// tensor, then launches on the current CUDA stream of that device.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace shardkit::cuda {

// tensor *= factor in place. Floating CUDA tensors only.
void scale_(at::Tensor& tensor, double factor);
// flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i], for every i, in ceil(n / 64) launches.
void pack_(at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets);
// tensors[i] = flat[offsets[i] : ...] * factor (factor 1: a plain copy; otherwise floating dtypes only).
void unpack_(const at::Tensor& flat, std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
             double factor);
// dst = (src * factor) cast to dst's dtype; f32, f64, f16, bf16; same numel.
void cast_scale_(at::Tensor& dst, const at::Tensor& src, double factor);
// Batched Gram-Schmidt in place on b x n x r matrices (torch's PowerSGD _orthogonalize_gram_schmidt).
void orthogonalize_(at::Tensor& matrices, double epsilon);

}  // namespace shardkit::cuda

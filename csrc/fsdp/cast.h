// The one call site of FSDP's precision casts: dst = src / divisor, rounded into dst's dtype.
//
// FlatParamHandle casts in three places (csrc/fsdp/flat_param.h): the copy-in of the shard into the full buffer
// (param_dtype), the flat gradient into the reduce dtype fused with the average's 1/N, and the reduced shard
// back to the parameters' dtype (with the 1/N still owed by a full-precision sum). All three go through
// cast_into, which picks the engine:
//   - CUDA tensors on one device (CUDA build), both contiguous, of f32/f64/f16/bf16: shardkit's cast_scale
//     kernel (csrc/cuda/cuda_ops.h) on the current stream, one pass. It MULTIPLIES by 1/divisor, computed in
//     f32 (f64 when either side is f64) and rounded once into dst. Where divisor is not a power of two that can
//     differ in the last bit from torch's division; where src is 16-bit and dst wider, it is the more precise
//     of the two (torch divides in src's dtype, rounding there first, then widens).
//   - everything else (CPU tensors, other dtypes, strided views): ATen. divisor 1 is a plain copy_ (torch's
//     rounding, bit for bit); otherwise at::div_out: a true division in src's dtype, then the cast into dst.
// divisor 1 with dst and src of one dtype is always a copy (no arithmetic). A cast between devices (the
// offload's host <-> device copies) is not this function's: those are copy_ calls on their own streams.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace shardkit::fsdp {

// dst and src: the same device and numel; dst may not overlap src unless they are one tensor of one dtype.
// `where` prefixes error messages (it names the rank, unit and op).
void cast_into(at::Tensor& dst, const at::Tensor& src, int64_t divisor, const std::string& where);

// src / divisor in `dtype`: src itself, divided in place, when it has that dtype already (ATen's div_, torch's
// division bit for bit, on any device); otherwise a new contiguous tensor on src's device, from cast_into.
at::Tensor divide_as(at::Tensor src, int64_t divisor, at::ScalarType dtype, const std::string& where);

}  // namespace shardkit::fsdp

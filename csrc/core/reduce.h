// shardkit core reduction loops: the element-wise inner loop of the shared-memory collectives, torch-free.
//
// What callers can rely on:
//  * Determinism. Each element is combined strictly left to right in source order,
//    dst[i] = op(...op(op(srcs[0][i], srcs[1][i]), srcs[2][i])..., srcs[nsrcs-1][i]),
//    and the vectorized and scalar paths produce bitwise identical results. So every rank that reduces the
//    same sources in the same order gets the same bytes, whatever ISA its CPU has. (One exception: when
//    several sources hold *different* NaN payloads at the same element, the result is NaN but which payload
//    survives is up to the hardware.)
//  * f16 / bf16 are widened to f32, combined in f32 across all sources, and rounded once at the end
//    (round-to-nearest-even; NaN stays NaN, overflow becomes inf). f32 and f64 combine in their own type.
//  * Min / Max on floating types propagate NaN, like torch.minimum / torch.maximum.
//  * Integer Sum / Product wrap around (two's complement), like torch's integer tensors.
//  * Bool: Sum, Max, BOr are logical or; Product, Min, BAnd are logical and; BXor is xor. Any non-zero input
//    byte counts as true; results are stored as 0 or 1.
//  * Aliasing: dst may be exactly one (or several) of the sources (same pointer), which is how the shm engine
//    reduces into its own slot. Partial overlap is refused with std::invalid_argument.
//  * Counts are size_t element counts; there is no 2 GiB limit. count == 0 is a no-op.
//
// Errors are std::invalid_argument with a message that names the op and dtype, e.g.
//   "shardkit reduce: op 'bxor' is not defined for dtype 'f32'".
// Input validation against user tensors belongs to the torch adapters; these checks guard the core's own
// invariants (and shm headers from a misbehaving peer).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace shardkit::core {

// dst[i] = op(srcs[0][i], ..., srcs[nsrcs-1][i]) for i in [0, count), with the guarantees above.
// All buffers hold `count` elements of `dtype`; no alignment is required.
// Throws std::invalid_argument for nsrcs < 1, a bitwise op on a floating dtype, an unknown dtype/op value,
// null pointers with count > 0, or dst partially overlapping a source.
void reduce_into(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op);

// data[i] = data[i] / divisor, in place: how AVG finishes after a Sum.
// Floating types divide by the divisor converted to the element's compute type (f32 for f16/bf16, rounded
// once back), so 1/0 gives inf as in torch. Integer types use truncating division, like
// torch.div(x, d, rounding_mode='trunc'); INT_MIN / -1 wraps to INT_MIN instead of trapping.
// Throws std::invalid_argument for Bool, for an integer dtype with divisor == 0, or null data with count > 0.
void divide_in_place(void* data, size_t count, DType dtype, int64_t divisor);

// The vector ISA the f32 / f16 / bf16 Sum and divide loops dispatch to, fastest first:
//   "avx512_bf16"  AVX-512 F+BW+DQ with AVX512-BF16 (bf16 rounding by vcvtne2ps2bf16)
//   "avx512"       AVX-512 F+BW
//   "avx2"         AVX2 + F16C
//   "scalar"       portable C++
// Chosen once, on first use, from what the CPU and OS support, unless the environment variable
// SHARDKIT_REDUCE_ISA names one of these (to measure a slower path); a name that is unknown or that this CPU
// cannot run makes every reduction throw std::invalid_argument naming the variable and the value.
const char* reduce_isa();

// --- testing ---------------------------------------------------------------------------------------------
// Forces the dispatch to `isa` (a name above), so tests can check that every path gives the same bytes;
// nullptr restores the automatic choice. Throws std::invalid_argument for an unknown name or an ISA this CPU
// cannot run. Safe to call while other threads reduce: every ISA gives the same bytes.
void set_reduce_isa_for_testing(const char* isa);

}  // namespace shardkit::core

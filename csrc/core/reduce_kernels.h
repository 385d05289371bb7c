// Internal to the reduction loops (reduce.cpp): the vector Sum and divide kernels, one table per ISA,
// implemented in reduce_x86.cpp. Not part of the core's public interface; reduce.h is.
//
// What every kernel promises (reduce.cpp relies on it to stay bitwise identical across ISAs):
//  * It handles a prefix of the elements, a multiple of its vector width, and returns how many; the caller's
//    scalar loop does the rest, so a kernel may stop anywhere on a vector boundary.
//  * Per element it computes exactly what the scalar loop would: f16/bf16 widen exactly to f32, Sum adds in
//    f32 in source order, and the result rounds once to nearest even (NaN: quiet bit set, payload kept).
//  * Element i of every source is read before dst[i] is written (dst may be one of the sources).
#pragma once

#include <cstddef>

namespace shardkit::core::detail {

// dst[i] = srcs[0][i] + ... + srcs[nsrcs - 1][i]; returns the number of leading elements done.
using SumKernel = size_t (*)(void* dst, const void* const* srcs, int nsrcs, size_t count);
// In place: data[i] / divisor, or data[i] * divisor when `multiply` (the caller passes the exact inverse of
// a power-of-two divisor then); returns the number of leading elements done.
using DivKernel = size_t (*)(void* data, size_t count, float divisor, bool multiply);

struct IsaKernels {
  const char* name;         // as SHARDKIT_REDUCE_ISA and reduce_isa() spell it
  bool (*cpu_can_run)();    // the CPU has the instructions and the OS saves the registers
  SumKernel sum_f32, sum_f16, sum_bf16;  // nullptr: the scalar loop does everything
  DivKernel div_f32, div_f16, div_bf16;
};

// The vector ISAs this build has kernels for, fastest first: avx512_bf16, avx512, avx2 on x86-64; none
// elsewhere. `count` receives how many.
const IsaKernels* const* vector_isas(size_t* count);

}  // namespace shardkit::core::detail

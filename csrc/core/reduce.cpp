// Reduction loops behind reduce.h: a portable blocked scalar path for every (dtype, op), validation, and
// the dispatch to the vector Sum / divide kernels of reduce_kernels.h (AVX2, AVX-512, AVX-512 + BF16 in
// reduce_x86.cpp), chosen once at runtime or by SHARDKIT_REDUCE_ISA.
//
// Why the code is shaped this way:
//  * Bitwise identical results across paths. Every path combines element i as acc = load(s0[i]);
//    acc = op(acc, load(sk[i])) for k = 1.. in order; store(acc). Vector lanes are independent elements, so
//    a vector kernel is just that many scalar chains side by side. The f16/bf16 conversions below are written
//    to match F16C (vcvtph2ps / vcvtps2ph) and the vector bf16 rounding bit for bit, NaN payloads included,
//    so a vector kernel can stop at any multiple of its width and the scalar loop finishes the tail.
//  * Exact aliasing (dst == some src) is safe because element i of every source is read before dst[i] is
//    written: the vector kernels keep the accumulators in registers, the scalar loop in a small stack block.
#include "core/reduce.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/half_float.h"
#include "core/reduce_kernels.h"

namespace shardkit::core {
namespace {

using half_float::bf16_to_f32;
using half_float::f16_to_f32;
using half_float::f32_to_bf16;
using half_float::f32_to_f16;

// ---- element traits: storage type T, accumulation type A -------------------------------------------------

template <class V>  // f32, f64 and the integers combine in their own type
struct EPlain {
  using T = V;
  using A = V;
  static A load(T v) { return v; }
  static T store(A a) { return a; }
};
struct EF16 {
  using T = uint16_t;
  using A = float;
  static A load(T v) { return f16_to_f32(v); }
  static T store(A a) { return f32_to_f16(a); }
};
struct EBF16 {
  using T = uint16_t;
  using A = float;
  static A load(T v) { return bf16_to_f32(v); }
  static T store(A a) { return f32_to_bf16(a); }
};
struct EBool {  // accumulates 0/1, so the bitwise ops below are the logical ones
  using T = uint8_t;
  using A = uint8_t;
  static A load(T v) { return v != 0; }
  static T store(A a) { return a; }
};

// ---- ops ------------------------------------------------------------------------------------------------

// Integers combine in their unsigned type, so Sum and Product wrap (two's complement) without signed-overflow UB.
template <class A>
using Unsigned = std::make_unsigned_t<A>;

struct OpSum {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return a + b;
    else return static_cast<A>(static_cast<Unsigned<A>>(a) + static_cast<Unsigned<A>>(b));
  }
};
struct OpProduct {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return a * b;
    else return static_cast<A>(static_cast<Unsigned<A>>(a) * static_cast<Unsigned<A>>(b));
  }
};
// Float min/max: a NaN on either side wins (a != a is the NaN test), as torch.minimum/maximum do.
struct OpMin {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a != a || a <= b) ? a : b;
    else return b < a ? b : a;
  }
};
struct OpMax {
  template <class A> static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) return (a != a || a >= b) ? a : b;
    else return a < b ? b : a;
  }
};
struct OpBAnd {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a & b); }
};
struct OpBOr {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a | b); }
};
struct OpBXor {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a ^ b); }
};

// ---- portable blocked loop ------------------------------------------------------------------------------
// Works a block at a time through an L1-resident accumulator: each inner loop is a plain stream the compiler
// autovectorizes, every source is read once, and dst is written only after the whole block is combined.

constexpr size_t kBlock = 1024;  // elements; at most 8 KiB of accumulator

template <class E, class Op>
void reduce_scalar(void* dst, const void* const* srcs, int nsrcs, size_t begin, size_t end) {
  using T = typename E::T;
  using A = typename E::A;
  A acc[kBlock];
  T* d = static_cast<T*>(dst);
  for (size_t base = begin; base < end; base += kBlock) {
    const size_t m = std::min(kBlock, end - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t j = 0; j < m; ++j) acc[j] = E::load(s0[j]);
    for (int k = 1; k < nsrcs; ++k) {
      const T* sk = static_cast<const T*>(srcs[k]) + base;
      for (size_t j = 0; j < m; ++j) acc[j] = Op::apply(acc[j], E::load(sk[j]));
    }
    for (size_t j = 0; j < m; ++j) d[base + j] = E::store(acc[j]);
  }
}

// ---- dispatch -------------------------------------------------------------------------------------------

using detail::DivKernel;
using detail::IsaKernels;
using detail::SumKernel;

bool always() { return true; }
constexpr IsaKernels kScalar{"scalar", &always, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};

const IsaKernels* find_isa(const char* name, const char* where) {
  size_t n = 0;
  const IsaKernels* const* vector = detail::vector_isas(&n);
  for (size_t i = 0; i <= n; ++i) {
    const IsaKernels* c = i < n ? vector[i] : &kScalar;
    if (std::strcmp(c->name, name) != 0) continue;
    if (!c->cpu_can_run()) {
      throw std::invalid_argument(std::string("shardkit reduce: this CPU cannot run ISA '") + name + "'" + where);
    }
    return c;
  }
  throw std::invalid_argument(std::string("shardkit reduce: unknown ISA '") + name + "'" + where +
                              " (expected avx512_bf16, avx512, avx2 or scalar)");
}

// SHARDKIT_REDUCE_ISA, when set, replaces the automatic choice (like ATen's ATEN_CPU_CAPABILITY): to
// measure or check a slower path on a CPU that has a faster one. A bad value fails every reduction with
// the message above, naming the variable, rather than being ignored.
const IsaKernels* detected_isa() {
  static const IsaKernels* const best = [] {
    const char* env = std::getenv("SHARDKIT_REDUCE_ISA");
    if (env != nullptr && *env != '\0') return find_isa(env, " (from SHARDKIT_REDUCE_ISA)");
    size_t n = 0;
    const IsaKernels* const* vector = detail::vector_isas(&n);
    for (size_t i = 0; i < n; ++i) {
      if (vector[i]->cpu_can_run()) return vector[i];
    }
    return &kScalar;
  }();
  return best;
}

std::atomic<const IsaKernels*> g_forced_isa{nullptr};

const IsaKernels& active_isa() {
  const IsaKernels* forced = g_forced_isa.load(std::memory_order_relaxed);
  return forced ? *forced : *detected_isa();
}

// ---- typed entry points ---------------------------------------------------------------------------------

template <class E>
void reduce_typed(void* dst, const void* const* srcs, int nsrcs, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return reduce_scalar<E, OpSum>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Product: return reduce_scalar<E, OpProduct>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Min: return reduce_scalar<E, OpMin>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Max: return reduce_scalar<E, OpMax>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      if constexpr (std::is_integral_v<typename E::A>) {
        if (op == ReduceOp::BAnd) return reduce_scalar<E, OpBAnd>(dst, srcs, nsrcs, 0, count);
        if (op == ReduceOp::BOr) return reduce_scalar<E, OpBOr>(dst, srcs, nsrcs, 0, count);
        return reduce_scalar<E, OpBXor>(dst, srcs, nsrcs, 0, count);
      }
      break;  // unreachable: validate() refused bitwise ops on floating dtypes
  }
}

void reduce_bool(void* dst, const void* const* srcs, int nsrcs, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Max:
    case ReduceOp::BOr: return reduce_scalar<EBool, OpBOr>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::Product:
    case ReduceOp::Min:
    case ReduceOp::BAnd: return reduce_scalar<EBool, OpBAnd>(dst, srcs, nsrcs, 0, count);
    case ReduceOp::BXor: return reduce_scalar<EBool, OpBXor>(dst, srcs, nsrcs, 0, count);
  }
}

template <class E>
void sum_float(SumKernel kernel, void* dst, const void* const* srcs, int nsrcs, size_t count) {
  const size_t done = kernel ? kernel(dst, srcs, nsrcs, count) : 0;
  reduce_scalar<E, OpSum>(dst, srcs, nsrcs, done, count);
}

std::string describe(ReduceOp op, DType dtype) {
  return std::string("op '") + reduce_op_name(op) + "', dtype '" + dtype_name(dtype) + "'";
}

bool is_known(ReduceOp op) { return static_cast<uint8_t>(op) <= static_cast<uint8_t>(ReduceOp::BXor); }

void validate(const void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op) {
  // Messages are built only on failure: this runs once per chunk of every collective.
  auto where = [&] { return describe(op, dtype); };
  if (!is_known(op)) {
    throw std::invalid_argument("shardkit reduce: unknown op value " + std::to_string(static_cast<int>(op)));
  }
  const size_t elem = dtype_size(dtype);  // throws for an unknown dtype value
  if (!is_integral(dtype) && (op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor)) {
    throw std::invalid_argument(std::string("shardkit reduce: op '") + reduce_op_name(op) +
                                "' is not defined for dtype '" + dtype_name(dtype) + "'");
  }
  if (nsrcs < 1) {
    throw std::invalid_argument("shardkit reduce: nsrcs must be >= 1, got " + std::to_string(nsrcs) + " (" +
                                where() + ")");
  }
  if (count == 0) return;
  if (dst == nullptr || srcs == nullptr) {
    throw std::invalid_argument("shardkit reduce: null dst or source list with count " + std::to_string(count) +
                                " (" + where() + ")");
  }
  const uintptr_t d0 = reinterpret_cast<uintptr_t>(dst);
  const size_t bytes = count * elem;
  for (int k = 0; k < nsrcs; ++k) {
    if (srcs[k] == nullptr) {
      throw std::invalid_argument("shardkit reduce: source " + std::to_string(k) + " is null (" + where() + ")");
    }
    const uintptr_t s = reinterpret_cast<uintptr_t>(srcs[k]);
    if (s != d0 && s < d0 + bytes && d0 < s + bytes) {
      throw std::invalid_argument("shardkit reduce: dst partially overlaps source " + std::to_string(k) +
                                  " (" + where() + "); it must be the same pointer or disjoint");
    }
  }
}

// Floats divide in their compute type (f32 for f16/bf16) and round once; kernel == nullptr for f64.
// When the divisor is a power of two whose inverse is a normal number (world sizes 2, 4, 8, ...), x / d
// and x * (1 / d) are the same real number, so they round to the same bits (subnormal results, inf, NaN
// payloads and MXCSR's FTZ/DAZ included); the multiply is several times cheaper, which is what keeps
// AVG of a 2-byte dtype bound by memory instead of by the divider.
template <class E>
void divide_float(DivKernel kernel, void* data, size_t count, typename E::A divisor) {
  using A = typename E::A;
  int exponent = 0;
  const A inverse = A(1) / divisor;
  const bool multiply = std::fabs(std::frexp(divisor, &exponent)) == A(0.5) &&
                        std::fabs(inverse) >= std::numeric_limits<A>::min();
  const A factor = multiply ? inverse : divisor;
  const size_t done = kernel ? kernel(data, count, static_cast<float>(factor), multiply) : 0;
  auto* p = static_cast<typename E::T*>(data);
  if (multiply) {
    for (size_t i = done; i < count; ++i) p[i] = E::store(E::load(p[i]) * factor);
  } else {
    for (size_t i = done; i < count; ++i) p[i] = E::store(E::load(p[i]) / factor);
  }
}

template <class T>
void divide_int(T* p, size_t count, int64_t divisor) {
  if (divisor == -1) {  // x / -1 is -x; do it in unsigned so INT_MIN wraps instead of trapping
    for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(0 - static_cast<uint64_t>(p[i]));
    return;
  }
  // C++ integer division truncates toward zero, which is rounding_mode='trunc'.
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<int64_t>(p[i]) / divisor);
}

}  // namespace

void reduce_into(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op) {
  validate(dst, srcs, nsrcs, count, dtype, op);
  if (count == 0) return;
  const IsaKernels& isa = active_isa();
  const bool sum = op == ReduceOp::Sum;
  switch (dtype) {
    case DType::F32:
      if (sum) return sum_float<EPlain<float>>(isa.sum_f32, dst, srcs, nsrcs, count);
      return reduce_typed<EPlain<float>>(dst, srcs, nsrcs, count, op);
    case DType::F16:
      if (sum) return sum_float<EF16>(isa.sum_f16, dst, srcs, nsrcs, count);
      return reduce_typed<EF16>(dst, srcs, nsrcs, count, op);
    case DType::BF16:
      if (sum) return sum_float<EBF16>(isa.sum_bf16, dst, srcs, nsrcs, count);
      return reduce_typed<EBF16>(dst, srcs, nsrcs, count, op);
    case DType::F64: return reduce_typed<EPlain<double>>(dst, srcs, nsrcs, count, op);
    case DType::U8: return reduce_typed<EPlain<uint8_t>>(dst, srcs, nsrcs, count, op);
    case DType::I8: return reduce_typed<EPlain<int8_t>>(dst, srcs, nsrcs, count, op);
    case DType::I32: return reduce_typed<EPlain<int32_t>>(dst, srcs, nsrcs, count, op);
    case DType::I64: return reduce_typed<EPlain<int64_t>>(dst, srcs, nsrcs, count, op);
    case DType::Bool: return reduce_bool(dst, srcs, nsrcs, count, op);
  }
}

void divide_in_place(void* data, size_t count, DType dtype, int64_t divisor) {
  const std::string name = dtype_name(dtype);
  dtype_size(dtype);  // throws for an unknown dtype value
  if (dtype == DType::Bool) {
    throw std::invalid_argument("shardkit reduce: divide is not defined for dtype 'bool'");
  }
  if (is_integral(dtype) && divisor == 0) {
    throw std::invalid_argument("shardkit reduce: integer division by zero for dtype '" + name + "'");
  }
  if (count == 0) return;
  if (data == nullptr) {
    throw std::invalid_argument("shardkit reduce: divide got null data with count " + std::to_string(count) +
                                " for dtype '" + name + "'");
  }
  const IsaKernels& isa = active_isa();
  switch (dtype) {
    case DType::F32: return divide_float<EPlain<float>>(isa.div_f32, data, count, static_cast<float>(divisor));
    case DType::F16: return divide_float<EF16>(isa.div_f16, data, count, static_cast<float>(divisor));
    case DType::BF16: return divide_float<EBF16>(isa.div_bf16, data, count, static_cast<float>(divisor));
    case DType::F64: return divide_float<EPlain<double>>(nullptr, data, count, static_cast<double>(divisor));
    case DType::U8: return divide_int(static_cast<uint8_t*>(data), count, divisor);
    case DType::I8: return divide_int(static_cast<int8_t*>(data), count, divisor);
    case DType::I32: return divide_int(static_cast<int32_t*>(data), count, divisor);
    case DType::I64: return divide_int(static_cast<int64_t*>(data), count, divisor);
    case DType::Bool: break;  // refused above
  }
}

const char* reduce_isa() { return active_isa().name; }

void set_reduce_isa_for_testing(const char* isa) {
  if (isa == nullptr) {
    g_forced_isa.store(nullptr, std::memory_order_relaxed);
    return;
  }
  g_forced_isa.store(find_isa(isa, ""), std::memory_order_relaxed);
}

}  // namespace shardkit::core

// shardkit core vocabulary: element types and reduction operators, torch-free.
//
// The torch adapters (csrc/comm/) translate at::ScalarType / c10d::ReduceOp into these; the core never sees
// torch. Values are stable: they travel in shared-memory op headers, so every rank must agree on them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardkit::core {

enum class DType : uint8_t {
  F32 = 0,
  F64 = 1,
  F16 = 2,
  BF16 = 3,
  U8 = 4,
  I8 = 5,
  I32 = 6,
  I64 = 7,
  Bool = 8,
};

enum class ReduceOp : uint8_t {
  Sum = 0,
  Product = 1,
  Min = 2,
  Max = 3,
  BAnd = 4,  // integers and bool only
  BOr = 5,   // integers and bool only
  BXor = 6,  // integers and bool only
};

// Bytes per element of `dtype`.
size_t dtype_size(DType dtype);
// Short lower-case name ("f32", "bf16", ...) for error messages.
const char* dtype_name(DType dtype);
// Lower-case name ("sum", "bxor", ...) for error messages.
const char* reduce_op_name(ReduceOp op);
// True for the integer types and Bool (the types bitwise operators accept).
bool is_integral(DType dtype);

}  // namespace shardkit::core

// Names and sizes for the core vocabulary in types.h.
//
// The name functions never throw: they are called while building error messages, including messages about
// a corrupt shared-memory header whose dtype/op byte is out of range, so they answer "unknown" instead.
#include "core/types.h"

#include <stdexcept>
#include <string>

namespace shardkit::core {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::U8: return 1;
    case DType::I8: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::Bool: return 1;
  }
  // A size of 0 would silently turn byte counts into 0, so an unknown dtype is an error here.
  throw std::invalid_argument("shardkit: unknown dtype value " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::U8: return "u8";
    case DType::I8: return "i8";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::Bool: return "bool";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::BAnd: return "band";
    case ReduceOp::BOr: return "bor";
    case ReduceOp::BXor: return "bxor";
  }
  return "unknown";
}

bool is_integral(DType dtype) {
  switch (dtype) {
    case DType::U8:
    case DType::I8:
    case DType::I32:
    case DType::I64:
    case DType::Bool:
      return true;
    case DType::F32:
    case DType::F64:
    case DType::F16:
    case DType::BF16:
      return false;
  }
  return false;
}

}  // namespace shardkit::core

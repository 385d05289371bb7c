#include "comm/tensor_args.h"

#include "comm/engine.h"
#include "compat.h"

namespace shardkit::comm {

namespace {

bool to_core_dtype(at::ScalarType type, core::DType* out) {
  switch (type) {
    case at::kFloat: *out = core::DType::F32; return true;
    case at::kDouble: *out = core::DType::F64; return true;
    case at::kHalf: *out = core::DType::F16; return true;
    case at::kBFloat16: *out = core::DType::BF16; return true;
    case at::kByte: *out = core::DType::U8; return true;
    case at::kChar: *out = core::DType::I8; return true;
    case at::kInt: *out = core::DType::I32; return true;
    case at::kLong: *out = core::DType::I64; return true;
    case at::kBool: *out = core::DType::Bool; return true;
    default: return false;
  }
}

const char* reduce_op_label(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNKNOWN";
  }
}

}  // namespace

core::DType core_dtype(const at::Tensor& tensor) {
  core::DType dtype;
  TORCH_INTERNAL_ASSERT(to_core_dtype(tensor.scalar_type(), &dtype), "unvalidated dtype ", tensor.scalar_type());
  return dtype;
}

std::string TensorArgs::where(const char* op) const {
  return std::string("shardkit ") + op + " (rank " + std::to_string(rank_) + "): ";
}

core::DType TensorArgs::check(const at::Tensor& tensor, const char* op) const {
  TORCH_CHECK(tensor.defined(), where(op), "got an undefined tensor");
#ifdef SHARDKIT_WITH_CUDA
  TORCH_CHECK(tensor.device().is_cpu() || tensor.device().is_cuda(), where(op), "tensor is on ", tensor.device(),
              "; shardkit drives CPU and CUDA tensors");
#else
  TORCH_CHECK(tensor.device().is_cpu(), where(op), "tensor is on ", tensor.device(),
              ", but this shardkit build drives CPU tensors only (CUDA tensors need the CUDA build with NCCL)");
#endif
  TORCH_CHECK(tensor.layout() == at::kStrided, where(op), "only dense (strided) tensors are supported, got layout ",
              tensor.layout());
  core::DType dtype;
  TORCH_CHECK(to_core_dtype(tensor.scalar_type(), &dtype), where(op), "dtype ", tensor.scalar_type(),
              " is not supported (float32, float64, float16, bfloat16, uint8, int8, int32, int64, bool are)");
  return dtype;
}

const at::Tensor& TensorArgs::single(const std::vector<at::Tensor>& tensors, const char* op) const {
  TORCH_CHECK(tensors.size() == 1, where(op), "expects exactly one tensor per process, got ", tensors.size());
  return tensors[0];
}

void TensorArgs::check_per_rank(const std::vector<at::Tensor>& tensors, const at::Tensor& like, const char* op,
                                const char* what) const {
  TORCH_CHECK(static_cast<int>(tensors.size()) == size_, where(op), what, " must hold one tensor per rank (",
              size_, "), got ", tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    check(tensors[i], op);
    TORCH_CHECK(tensors[i].scalar_type() == like.scalar_type(), where(op), what, "[", i, "] has dtype ",
                tensors[i].scalar_type(), ", expected ", like.scalar_type());
    TORCH_CHECK(tensors[i].numel() == like.numel(), where(op), what, "[", i, "] has ", tensors[i].numel(),
                " elements, expected ", like.numel());
    TORCH_CHECK(tensors[i].device() == like.device(), where(op), "tensors on different devices in one collective: ",
                what, "[", i, "] is on ", tensors[i].device(), ", the input on ", like.device());
  }
}

void TensorArgs::check_same(const at::Tensor& a, const at::Tensor& b, const char* op) const {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), where(op), "output dtype ", a.scalar_type(),
              " differs from input dtype ", b.scalar_type());
  check_same_device(a, b, op);
}

void TensorArgs::check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) const {
  TORCH_CHECK(a.device() == b.device(), where(op), "tensors on different devices in one collective: ", a.device(),
              " and ", b.device());
}

void TensorArgs::check_numel(const at::Tensor& tensor, int64_t expected, const char* op, const char* what) const {
  TORCH_CHECK(tensor.numel() == expected, where(op), what, " has ", tensor.numel(), " elements, expected ", expected);
}

void TensorArgs::check_root(int64_t root, const char* op) const {
  TORCH_CHECK(root >= 0 && root < size_, where(op), "root rank ", root, " is outside the group of size ", size_);
}

std::vector<size_t> TensorArgs::split_counts(const at::Tensor& tensor, const std::vector<int64_t>& splits,
                                            const char* op, const char* what) const {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  const int64_t row_numel = rows == 0 ? 0 : tensor.numel() / rows;
  std::vector<size_t> counts(size_);
  if (splits.empty()) {
    TORCH_CHECK(rows % size_ == 0, where(op), what, " dim 0 (", rows, ") is not divisible by the group size ", size_,
                "; pass split sizes");
    for (auto& count : counts) count = static_cast<size_t>(rows / size_ * row_numel);
    return counts;
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == size_, where(op), what, " split sizes have ", splits.size(),
              " entries, expected ", size_);
  int64_t total = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    TORCH_CHECK(splits[i] >= 0, where(op), what, " split size ", splits[i], " is negative");
    counts[i] = static_cast<size_t>(splits[i] * row_numel);
    total += splits[i];
  }
  TORCH_CHECK(total == rows, where(op), what, " split sizes sum to ", total, ", but dim 0 is ", rows);
  return counts;
}

ReduceSpec TensorArgs::reduce_spec(const c10d::ReduceOp& op, at::ScalarType dtype, const char* name) const {
  ReduceSpec spec;
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  switch (op.op_) {
    case c10d::ReduceOp::SUM: spec.op = core::ReduceOp::Sum; break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(dtype != at::kBool, where(name), "reduce op AVG is not defined for dtype Bool");
      spec.op = core::ReduceOp::Sum;
      spec.average = true;
      break;
    case c10d::ReduceOp::PRODUCT: spec.op = core::ReduceOp::Product; break;
    case c10d::ReduceOp::MIN: spec.op = core::ReduceOp::Min; break;
    case c10d::ReduceOp::MAX: spec.op = core::ReduceOp::Max; break;
    case c10d::ReduceOp::BAND: spec.op = core::ReduceOp::BAnd; break;
    case c10d::ReduceOp::BOR: spec.op = core::ReduceOp::BOr; break;
    case c10d::ReduceOp::BXOR: spec.op = core::ReduceOp::BXor; break;
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK(at::isFloatingType(dtype), where(name), "reduce op PREMUL_SUM needs a floating dtype, got ", dtype);
      spec.op = core::ReduceOp::Sum;
      spec.premultiply = true;
      spec.factor = compat::premul_sum_factor(op);
      break;
    default: TORCH_CHECK(false, where(name), "reduce op ", reduce_op_label(op.op_), " is not supported");
  }
  const bool bitwise = spec.op == core::ReduceOp::BAnd || spec.op == core::ReduceOp::BOr ||
                       spec.op == core::ReduceOp::BXor;
  TORCH_CHECK(!bitwise || integral, where(name), "reduce op ", reduce_op_label(op.op_),
              " is defined for integer and bool tensors only, got ", dtype);
  return spec;
}

at::Tensor concat_flat(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  flat.reserve(parts.size());
  for (const auto& part : parts) flat.push_back(part.reshape({-1}));
  return at::cat(flat);
}

void split_flat(const at::Tensor& flat, std::vector<at::Tensor>& parts) {
  int64_t offset = 0;
  for (auto& part : parts) {
    const int64_t n = part.numel();
    part.copy_(flat.narrow(0, offset, n).view(part.sizes()));
    offset += n;
  }
}

}  // namespace shardkit::comm

// Validation and translation of the tensors and options a collective receives, shared by every op of the
// shardkit backend. All user-facing checks of csrc/comm/ live here: each failure names the rank, the op
// and the offending value.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "core/types.h"

namespace shardkit::comm {

// What a c10d::ReduceOp means for the shared-memory engine: a core op plus an optional pre-scale
// (PREMUL_SUM) and post-division (AVG).
struct ReduceSpec {
  core::ReduceOp op = core::ReduceOp::Sum;
  bool average = false;     // divide the result by the group size
  bool premultiply = false;  // multiply every input by `factor` before summing
  double factor = 1.0;

  // The same op once the inputs have been scaled already.
  ReduceSpec without_premultiply() const {
    ReduceSpec spec = *this;
    spec.premultiply = false;
    return spec;
  }
};

class TensorArgs {
 public:
  TensorArgs(int rank, int size) : rank_(rank), size_(size) {}

  // Prefix for messages: "shardkit <op> (rank <r>): ".
  std::string where(const char* op) const;

  // A dense CPU tensor of a supported dtype; returns its core dtype.
  core::DType check(const at::Tensor& tensor, const char* op) const;
  // Exactly one tensor in a list (shardkit drives one device per process).
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) const;
  // `tensors` has one entry per rank, each of `like`'s dtype and numel.
  void check_per_rank(const std::vector<at::Tensor>& tensors, const at::Tensor& like, const char* op,
                      const char* what) const;
  void check_same(const at::Tensor& a, const at::Tensor& b, const char* op) const;  // same dtype and device
  void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) const;
  void check_numel(const at::Tensor& tensor, int64_t expected, const char* op, const char* what) const;
  void check_root(int64_t root, const char* op) const;
  // Elements per rank of an all-to-all tensor: `splits` count rows of dim 0 (one entry per rank); no
  // splits means dim 0 divides evenly among the ranks.
  std::vector<size_t> split_counts(const at::Tensor& tensor, const std::vector<int64_t>& splits, const char* op,
                                   const char* what) const;
  ReduceSpec reduce_spec(const c10d::ReduceOp& op, at::ScalarType dtype, const char* name) const;

 private:
  int rank_;
  int size_;
};

// Runs an op on a contiguous version of `tensor` and writes the result back if a copy was needed.
// The body receives the contiguous tensor.
template <typename Body>
void with_contiguous(at::Tensor& tensor, Body&& body) {
  if (tensor.is_contiguous()) {
    body(tensor);
    return;
  }
  at::Tensor staged = tensor.contiguous();
  body(staged);
  tensor.copy_(staged);
}

// One contiguous buffer holding the tensors of `parts` back to back (the layout of flat collectives).
at::Tensor concat_flat(const std::vector<at::Tensor>& parts);
// Copies consecutive pieces of `flat` back into `parts`.
void split_flat(const at::Tensor& flat, std::vector<at::Tensor>& parts);

}  // namespace shardkit::comm

// The one place where shardkit bridges differences between the torch versions it supports
// (2.11, 2.13, 2.14). Adapters include this instead of testing TORCH_VERSION themselves.
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/version.h>

#include <utility>

namespace shardkit::compat {

#define SHARDKIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// The scale factor of a PREMUL_SUM reduce op (torch 2.x keeps it in a type-erased supplement). The
// supplement was renamed PreMulSumSupplement in newer releases, which keep NCCLPreMulSumSupplement as an
// alias: the old name is the one that exists in 2.11, 2.13 and 2.14 alike.
inline double premul_sum_factor(const c10d::ReduceOp& op) {
  auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "shardkit: PREMUL_SUM reduce op carries no scale factor");
  TORCH_CHECK(!supplement->tensor_factor.defined(),
              "shardkit: PREMUL_SUM with a tensor factor is not supported; pass a Python float");
  return supplement->double_factor;
}

// Whether the caller will wait on the Work itself (`async_op=False`). The options structs carry asyncOp
// since torch 2.7; treat older ones as asynchronous, the safe assumption.
template <typename Options>
inline bool is_async_op(const Options& opts) {
#if SHARDKIT_TORCH_AT_LEAST(2, 7)
  return opts.asyncOp;
#else
  (void)opts;
  return true;
#endif
}

// The handle torch returns for a parameter's gradient accumulator (an autograd Node). Its holder type has
// changed between releases (std::shared_ptr, then c10::intrusive_ptr); take whatever this torch returns.
using GradAccumulatorHandle = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// Marks options for a caller that waits on the Work at once (`async_op=False`): backends may then run the
// op on the calling thread (shardkit's does), so everything it holds is released before the call returns.
// A no-op before torch 2.7, whose options have no asyncOp.
template <typename Options>
inline Options waited_at_once(Options opts) {
#if SHARDKIT_TORCH_AT_LEAST(2, 7)
  opts.asyncOp = false;
#endif
  return opts;
}

// One-tensor all-gather and reduce-scatter on a ProcessGroup. torch 2.13 renamed _allgather_base and
// _reduce_scatter_base to all_gather_single / reduce_scatter_single (the old names now warn as deprecated).
inline c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                        at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) {
#if SHARDKIT_TORCH_AT_LEAST(2, 13)
  return group.all_gather_single(output, input, opts);
#else
  return group._allgather_base(output, input, opts);
#endif
}

inline c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                            at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
#if SHARDKIT_TORCH_AT_LEAST(2, 13)
  return group.reduce_scatter_single(output, input, opts);
#else
  return group._reduce_scatter_base(output, input, opts);
#endif
}

}  // namespace shardkit::compat

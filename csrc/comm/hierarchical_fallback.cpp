// The gloo fallback of HierarchicalEngine: gather, scatter and all-to-all run as one gloo collective over all the
// group's ranks (InnerBackends::all_ranks), since a hierarchy saves nothing for them on the CPU.
//
// Promise: tensors travel as raw bytes, so any dtype works and uneven all-to-all counts pair as given; the op's
// timeout bounds the wait, and a failure aborts the group like any other step (guarded, wait_inner).
#include "comm/hierarchical_engine.h"

#include <vector>

#include "comm/hierarchical_internal.h"

namespace shardkit::comm {

using namespace hierarchical;

void HierarchicalEngine::gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  guarded(op, std::nullopt, [&] {
    std::vector<at::Tensor> inputs{as_bytes(input)};
    std::vector<std::vector<at::Tensor>> outputs;
    if (rank_ == root) outputs.push_back(as_bytes(output).chunk(size_));
    c10d::GatherOptions options;
    options.rootRank = root;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "gather (gloo over all ranks)", all_ranks, all_ranks->gather(outputs, inputs, options));
  });
}

void HierarchicalEngine::scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  guarded(op, std::nullopt, [&] {
    std::vector<at::Tensor> outputs{as_bytes(output)};
    std::vector<std::vector<at::Tensor>> inputs;
    if (rank_ == root) inputs.push_back(as_bytes(input).chunk(size_));
    c10d::ScatterOptions options;
    options.rootRank = root;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "scatter (gloo over all ranks)", all_ranks, all_ranks->scatter(outputs, inputs, options));
  });
}

void HierarchicalEngine::alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                                  at::Tensor& output, const std::vector<size_t>& recv_counts) {
  guarded(op, std::nullopt, [&] {
    const int64_t elem = static_cast<int64_t>(input.element_size());
    std::vector<int64_t> send_bytes, recv_bytes;
    for (size_t count : send_counts) send_bytes.push_back(static_cast<int64_t>(count) * elem);
    for (size_t count : recv_counts) recv_bytes.push_back(static_cast<int64_t>(count) * elem);
    at::Tensor in = as_bytes(input);
    at::Tensor out = as_bytes(output);
    c10d::AllToAllOptions options;
    options.timeout = op.timeout;
    c10::intrusive_ptr<c10d::Backend> all_ranks = inner_->all_ranks(op.where());
    wait_inner(op, "all-to-all (gloo over all ranks)", all_ranks,
               all_ranks->alltoall_base(out, in, recv_bytes, send_bytes, options));
  });
}

}  // namespace shardkit::comm

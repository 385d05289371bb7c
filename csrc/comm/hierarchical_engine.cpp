// HierarchicalEngine's frame (hierarchical_engine.h): where the group's ranks sit, the engine's construction
// and shutdown, and each collective's choice of scheme: the rails for large ops where the group has them
// (use_rails), else the leaders. The schemes themselves are in hierarchical_leaders.cpp and hierarchical_rails.cpp.
//
// Promise: every op runs guarded (hierarchical_failure.cpp), and the choice depends only on what is the same on every
// rank (the group's rails, the op's bytes), so all ranks of the group take the same path.
#include "comm/hierarchical_engine.h"

#include <algorithm>

#include "comm/hierarchical_internal.h"

namespace shardkit::comm {

using namespace hierarchical;

int HostLayout::num_hosts() const { return host_of.empty() ? 0 : *std::max_element(host_of.begin(), host_of.end()) + 1; }

std::vector<int> HostLayout::ranks_of(int host) const {
  std::vector<int> ranks;
  for (size_t r = 0; r < host_of.size(); ++r) {
    if (host_of[r] == host) ranks.push_back(static_cast<int>(r));
  }
  return ranks;  // ascending global rank == local order
}

HierarchicalEngine::HierarchicalEngine(int rank, int size, HostLayout layout, bool rails,
                                       std::unique_ptr<core::ShmGroup> local, std::shared_ptr<InnerBackends> inner,
                                       std::shared_ptr<FailureNotices> notices)
    : rank_(rank),
      size_(size),
      layout_(std::move(layout)),
      host_(layout_.host_of.at(rank)),
      local_rank_(layout_.local_of.at(rank)),
      max_local_size_(0),
      rails_(rails),
      local_(std::move(local)),
      inner_(std::move(inner)),
      notices_(std::move(notices)),
      exchanges_(std::make_unique<ExchangeWaiter>()) {
  for (int h = 0; h < layout_.num_hosts(); ++h) {
    hosts_.push_back(layout_.ranks_of(h));
    max_local_size_ = std::max(max_local_size_, static_cast<int>(hosts_.back().size()));
  }
  if (rails_) {  // the creator's promise (backend.h): equal hosts of consecutive ranks, two or more each
    for (const std::vector<int>& ranks : hosts_) {
      TORCH_CHECK(static_cast<int>(ranks.size()) == max_local_size_ && ranks.size() >= 2 &&
                      ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size()),
                  "shardkit (rank ", rank, "): rails need hosts of equal numbers (2+) of consecutive ranks");
    }
  }
}

HierarchicalEngine::~HierarchicalEngine() { exchanges_->stop(); }

void HierarchicalEngine::shutdown() { exchanges_->stop(); }

void HierarchicalEngine::allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  guarded(op, LeaderStep{core::OpKind::AllReduce, numel_of(data), core_dtype(data)}, [&] {
    if (use_rails(data.nbytes())) {
      pipelined_allreduce(op, data, reduce, /*in_host_steps=*/true);
    } else {
      leaders_allreduce(op, data, reduce);
    }
  });
}

void HierarchicalEngine::allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  guarded(op, LeaderStep{core::OpKind::AllGather, numel_of(input), core_dtype(input)}, [&] {
    if (use_rails(output.nbytes())) {
      rails_allgather(op, input, output);
    } else {
      leaders_allgather(op, input, output);
    }
  });
}

void HierarchicalEngine::reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                        core::ReduceOp reduce) {
  guarded(op, LeaderStep{core::OpKind::ReduceScatter, numel_of(output), core_dtype(output)}, [&] {
    if (use_rails(input.nbytes())) {
      rails_reduce_scatter(op, input, output, reduce);
    } else {
      leaders_reduce_scatter(op, input, output, reduce);
    }
  });
}

}  // namespace shardkit::comm

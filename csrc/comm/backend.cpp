#include "comm/backend.h"

#include <numeric>

#include "compat.h"
#include "core/reduce.h"

namespace shardkit::comm {

namespace {

size_t numel_of(const at::Tensor& tensor) { return static_cast<size_t>(tensor.numel()); }

// Waits for an inner backend's work on the worker thread; its exceptions propagate to our Work.
void wait_inner(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) { work->wait(timeout); }

std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
  return offsets;
}

}  // namespace

// The c10d op that combines per-host partial results between hosts.
c10d::ReduceOp::RedOpType inter_host_op(core::ReduceOp op) {
  switch (op) {
    case core::ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case core::ReduceOp::Product: return c10d::ReduceOp::PRODUCT;
    case core::ReduceOp::Min: return c10d::ReduceOp::MIN;
    case core::ReduceOp::Max: return c10d::ReduceOp::MAX;
    case core::ReduceOp::BAnd: return c10d::ReduceOp::BAND;
    case core::ReduceOp::BOr: return c10d::ReduceOp::BOR;
    case core::ReduceOp::BXor: return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::UNUSED;
}

ProcessGroupShardkit::ProcessGroupShardkit(int rank, int size, const Config& config,
                                           c10::intrusive_ptr<c10d::Backend> fallback,
                                           c10::intrusive_ptr<c10d::Backend> inter_host)
    : c10d::Backend(rank, size),
      args_(rank, size),
      config_(config),
      timeout_(config.timeout),
      fallback_(std::move(fallback)),
      inter_host_(std::move(inter_host)) {
  TORCH_CHECK(config.num_hosts >= 1 && config.local_size >= 1 && config.local_rank < config.local_size,
              "shardkit (rank ", rank, "): invalid host topology: local rank ", config.local_rank, " of ",
              config.local_size, " on ", config.num_hosts, " host(s)");
  TORCH_CHECK(config.num_hosts == 1 || (static_cast<int>(config.host_of.size()) == size &&
                                        static_cast<int>(config.local_of.size()) == size),
              "shardkit (rank ", rank, "): host maps must have one entry per rank");
  TORCH_CHECK(config.num_hosts == 1 || config.local_rank != 0 || inter_host_,
              "shardkit (rank ", rank, "): a host leader needs the inter-host backend");
  core::ShmGroup::Options options;
  options.name = config.shm_name;
  options.rank = config.local_rank;
  options.size = config.local_size;
  options.slot_bytes = config.slot_bytes;
  options.timeout = config.timeout;
  try {
    group_ = std::make_unique<core::ShmGroup>(options);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, error.what());
  }
}

ProcessGroupShardkit::~ProcessGroupShardkit() = default;

void ProcessGroupShardkit::shutdown() {
  queue_.stop();
  if (fallback_) fallback_->shutdown();
  if (inter_host_) inter_host_->shutdown();
}

std::chrono::milliseconds ProcessGroupShardkit::op_timeout(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

template <typename OpOptions>
c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::launch(c10d::OpType type, const char* title,
                                                            std::vector<at::Tensor> outputs, const OpOptions& opts,
                                                            std::function<void()> body) {
  auto work = c10::make_intrusive<ShardkitWork>(getRank(), type, title, std::move(outputs));
  const std::chrono::milliseconds timeout = op_timeout(opts.timeout);
  auto run = [this, timeout, body = std::move(body)] {
    group_->set_timeout(timeout);
    body();
  };
  if (compat::is_async_op(opts)) {
    queue_.enqueue(work, std::move(run));
  } else {
    queue_.run_or_enqueue(work, std::move(run));
  }
  return work;
}

c10d::Backend& ProcessGroupShardkit::fallback(const char* op) {
  TORCH_CHECK(fallback_, args_.where(op), "this op needs the inner gloo backend, which this group lacks");
  return *fallback_;
}

void ProcessGroupShardkit::reduce_tensor(at::Tensor& tensor, core::DType dtype, const ReduceSpec& spec, int root) {
  if (spec.premultiply) tensor.mul_(spec.factor);
  void* data = tensor.data_ptr();
  const size_t count = numel_of(tensor);
  if (!multi_host()) {
    if (root < 0) {
      group_->allreduce(data, data, count, dtype, spec.op);
    } else {
      group_->reduce(data, data, count, dtype, spec.op, root);
    }
  } else {
    // Reduce within the host to its leader, combine the hosts' partial results among the leaders,
    // then hand the result back out within each host. (reduce with a root goes to fallback instead.)
    TORCH_INTERNAL_ASSERT(root < 0, "hierarchical reduce with a root is routed to the fallback backend");
    group_->reduce(data, data, count, dtype, spec.op, 0);
    if (inter_host_) {
      std::vector<at::Tensor> partial{tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp(inter_host_op(spec.op));
      wait_inner(inter_host_->allreduce(partial, options), timeout_);
    }
    group_->broadcast(data, count, dtype, 0);
  }
  if (spec.average && (root < 0 || root == getRank())) core::divide_in_place(data, count, dtype, getSize());
}

void ProcessGroupShardkit::broadcast_tensor(at::Tensor& tensor, core::DType dtype, int root) {
  void* data = tensor.data_ptr();
  const size_t count = numel_of(tensor);
  if (!multi_host()) {
    group_->broadcast(data, count, dtype, root);
    return;
  }
  // The root's host first spreads it locally (so its leader has it), then the leaders exchange it, then
  // every other host spreads it from its leader. Each host sees one consistent sequence of shm ops.
  const int root_host = config_.host_of[root];
  const bool on_root_host = config_.host_index == root_host;
  if (on_root_host) group_->broadcast(data, count, dtype, config_.local_of[root]);
  if (inter_host_) {
    std::vector<at::Tensor> payload{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root_host;
    wait_inner(inter_host_->broadcast(payload, options), timeout_);
  }
  if (!on_root_host) group_->broadcast(data, count, dtype, 0);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  at::Tensor tensor = args_.single(tensors, "broadcast");
  const core::DType dtype = args_.check(tensor, "broadcast");
  args_.check_root(opts.rootRank, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::BROADCAST, "shardkit:broadcast", {tensor}, opts,
                [this, tensor, dtype, root]() mutable {
                  with_contiguous(tensor, [&](at::Tensor& t) { broadcast_tensor(t, dtype, root); });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  at::Tensor tensor = args_.single(tensors, "allreduce");
  const core::DType dtype = args_.check(tensor, "allreduce");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensor.scalar_type(), "allreduce");
  return launch(c10d::OpType::ALLREDUCE, "shardkit:allreduce", {tensor}, opts,
                [this, tensor, dtype, spec]() mutable {
                  with_contiguous(tensor, [&](at::Tensor& t) { reduce_tensor(t, dtype, spec, -1); });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                         const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), args_.where("allreduce_coalesced"), "got no tensors");
  const core::DType dtype = args_.check(tensors[0], "allreduce_coalesced");
  for (const auto& tensor : tensors) {
    args_.check(tensor, "allreduce_coalesced");
    args_.check_same(tensor, tensors[0], "allreduce_coalesced");
  }
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensors[0].scalar_type(), "allreduce_coalesced");
  return launch(c10d::OpType::ALLREDUCE_COALESCED, "shardkit:allreduce_coalesced", tensors, opts,
                [this, tensors, dtype, spec]() mutable {
                  at::Tensor flat = concat_flat(tensors);
                  reduce_tensor(flat, dtype, spec, -1);
                  split_flat(flat, tensors);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  if (multi_host()) return fallback("reduce").reduce(tensors, opts);
  at::Tensor tensor = args_.single(tensors, "reduce");
  const core::DType dtype = args_.check(tensor, "reduce");
  args_.check_root(opts.rootRank, "reduce");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensor.scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::REDUCE, "shardkit:reduce", {tensor}, opts,
                [this, tensor, dtype, spec, root]() mutable {
                  if (getRank() == root) {
                    with_contiguous(tensor, [&](at::Tensor& t) { reduce_tensor(t, dtype, spec, root); });
                  } else {
                    // Non-root tensors stay as they are: reduce a scaled/contiguous copy if needed.
                    at::Tensor staged = spec.premultiply ? tensor.clone(at::MemoryFormat::Contiguous) : tensor.contiguous();
                    reduce_tensor(staged, dtype, spec, root);
                  }
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  if (multi_host()) return fallback("allgather").allgather(outputs, inputs, opts);
  at::Tensor input = args_.single(inputs, "allgather");
  const core::DType dtype = args_.check(input, "allgather");
  TORCH_CHECK(outputs.size() == 1, args_.where("allgather"), "expects one output list, got ", outputs.size());
  std::vector<at::Tensor> out = outputs[0];
  args_.check_per_rank(out, input, "allgather", "output_tensor_list");
  return launch(c10d::OpType::ALLGATHER, "shardkit:allgather", out, opts,
                [this, input, out, dtype]() mutable {
                  at::Tensor in = input.contiguous();
                  at::Tensor flat = at::empty({input.numel() * getSize()}, input.options());
                  group_->allgather(in.data_ptr(), flat.data_ptr(), numel_of(in), dtype);
                  split_flat(flat, out);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::AllgatherOptions& opts) {
  if (multi_host()) return fallback("all_gather_into_tensor")._allgather_base(output, input, opts);
  const core::DType dtype = args_.check(input, "all_gather_into_tensor");
  args_.check(output, "all_gather_into_tensor");
  args_.check_same(output, input, "all_gather_into_tensor");
  args_.check_numel(output, input.numel() * getSize(), "all_gather_into_tensor", "output");
  return launch(c10d::OpType::_ALLGATHER_BASE, "shardkit:all_gather_into_tensor", {output}, opts,
                [this, output, input, dtype]() mutable {
                  at::Tensor in = input.contiguous();
                  with_contiguous(output, [&](at::Tensor& out) {
                    group_->allgather(in.data_ptr(), out.data_ptr(), numel_of(in), dtype);
                  });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), args_.where("allgather_into_tensor_coalesced"), "got ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<core::DType> dtypes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dtypes.push_back(args_.check(inputs[i], "allgather_into_tensor_coalesced"));
    args_.check(outputs[i], "allgather_into_tensor_coalesced");
    args_.check_same(outputs[i], inputs[i], "allgather_into_tensor_coalesced");
    args_.check_numel(outputs[i], inputs[i].numel() * getSize(), "allgather_into_tensor_coalesced", "output");
  }
  return launch(c10d::OpType::COALESCED, "shardkit:allgather_into_tensor_coalesced", outputs, opts,
                [this, outputs, inputs, dtypes]() mutable {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    at::Tensor in = inputs[i].contiguous();
                    with_contiguous(outputs[i], [&](at::Tensor& out) {
                      group_->allgather(in.data_ptr(), out.data_ptr(), numel_of(in), dtypes[i]);
                    });
                  }
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::GatherOptions& opts) {
  if (multi_host()) return fallback("gather").gather(outputs, inputs, opts);
  at::Tensor input = args_.single(inputs, "gather");
  const core::DType dtype = args_.check(input, "gather");
  args_.check_root(opts.rootRank, "gather");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> out;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1, args_.where("gather"), "root expects one output list, got ", outputs.size());
    out = outputs[0];
    args_.check_per_rank(out, input, "gather", "gather_list");
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), args_.where("gather"),
                "only the root (rank ", root, ") passes a gather_list");
  }
  return launch(c10d::OpType::GATHER, "shardkit:gather", out, opts,
                [this, input, out, dtype, root]() mutable {
                  at::Tensor in = input.contiguous();
                  at::Tensor flat;
                  if (getRank() == root) flat = at::empty({input.numel() * getSize()}, input.options());
                  group_->gather(in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, numel_of(in), dtype, root);
                  if (flat.defined()) split_flat(flat, out);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  if (multi_host()) return fallback("scatter").scatter(outputs, inputs, opts);
  at::Tensor output = args_.single(outputs, "scatter");
  const core::DType dtype = args_.check(output, "scatter");
  args_.check_root(opts.rootRank, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> in;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1, args_.where("scatter"), "root expects one scatter_list, got ", inputs.size());
    in = inputs[0];
    args_.check_per_rank(in, output, "scatter", "scatter_list");
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), args_.where("scatter"),
                "only the root (rank ", root, ") passes a scatter_list");
  }
  return launch(c10d::OpType::SCATTER, "shardkit:scatter", {output}, opts,
                [this, output, in, dtype, root]() mutable {
                  at::Tensor flat = in.empty() ? at::Tensor() : concat_flat(in);
                  with_contiguous(output, [&](at::Tensor& out) {
                    group_->scatter(flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(), numel_of(out), dtype, root);
                  });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                                    const c10d::ReduceScatterOptions& opts) {
  if (multi_host()) return fallback("reduce_scatter").reduce_scatter(outputs, inputs, opts);
  at::Tensor output = args_.single(outputs, "reduce_scatter");
  const core::DType dtype = args_.check(output, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, args_.where("reduce_scatter"), "expects one input list, got ", inputs.size());
  std::vector<at::Tensor> in = inputs[0];
  args_.check_per_rank(in, output, "reduce_scatter", "input_list");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, output.scalar_type(), "reduce_scatter");
  return launch(c10d::OpType::REDUCE_SCATTER, "shardkit:reduce_scatter", {output}, opts,
                [this, output, in, dtype, spec]() mutable {
                  at::Tensor flat = concat_flat(in);
                  if (spec.premultiply) flat.mul_(spec.factor);
                  with_contiguous(output, [&](at::Tensor& out) {
                    group_->reduce_scatter(flat.data_ptr(), out.data_ptr(), numel_of(out), dtype, spec.op);
                    if (spec.average) core::divide_in_place(out.data_ptr(), numel_of(out), dtype, getSize());
                  });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                          const c10d::ReduceScatterOptions& opts) {
  if (multi_host()) return fallback("reduce_scatter_tensor")._reduce_scatter_base(output, input, opts);
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  TORCH_CHECK(outputs.size() == inputs.size(), args_.where(op), "got ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  std::vector<core::DType> dtypes;
  std::vector<ReduceSpec> specs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dtypes.push_back(args_.check(inputs[i], op));
    args_.check(outputs[i], op);
    args_.check_same(outputs[i], inputs[i], op);
    args_.check_numel(inputs[i], outputs[i].numel() * getSize(), op, "input");
    specs.push_back(args_.reduce_spec(opts.reduceOp, inputs[i].scalar_type(), op));
  }
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, "shardkit:reduce_scatter_tensor", outputs,
                opts, [this, outputs, inputs, dtypes, specs]() mutable {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    at::Tensor in = specs[i].premultiply ? inputs[i].mul(specs[i].factor) : inputs[i].contiguous();
                    with_contiguous(outputs[i], [&](at::Tensor& out) {
                      group_->reduce_scatter(in.data_ptr(), out.data_ptr(), numel_of(out), dtypes[i], specs[i].op);
                      if (specs[i].average) core::divide_in_place(out.data_ptr(), numel_of(out), dtypes[i], getSize());
                    });
                  }
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                   std::vector<int64_t>& output_split_sizes,
                                                                   std::vector<int64_t>& input_split_sizes,
                                                                   const c10d::AllToAllOptions& opts) {
  if (multi_host()) return fallback("all_to_all_single").alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  const char* op = "all_to_all_single";
  const core::DType dtype = args_.check(input, op);
  args_.check(output, op);
  args_.check_same(output, input, op);
  // Splits count rows of dim 0; no splits means dim 0 divides evenly among the ranks.
  auto element_counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row_numel = rows == 0 ? 0 : t.numel() / rows;
    std::vector<size_t> counts(getSize());
    if (splits.empty()) {
      TORCH_CHECK(rows % getSize() == 0, args_.where(op), what, " dim 0 (", rows,
                  ") is not divisible by the group size ", getSize(), "; pass split sizes");
      for (auto& c : counts) c = static_cast<size_t>(rows / getSize() * row_numel);
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == getSize(), args_.where(op), what, " split sizes have ",
                  splits.size(), " entries, expected ", getSize());
      int64_t total = 0;
      for (size_t i = 0; i < splits.size(); ++i) {
        TORCH_CHECK(splits[i] >= 0, args_.where(op), what, " split size ", splits[i], " is negative");
        counts[i] = static_cast<size_t>(splits[i] * row_numel);
        total += splits[i];
      }
      TORCH_CHECK(total == rows, args_.where(op), what, " split sizes sum to ", total, ", but dim 0 is ", rows);
    }
    return counts;
  };
  const std::vector<size_t> send_counts = element_counts(input, input_split_sizes, "input");
  const std::vector<size_t> recv_counts = element_counts(output, output_split_sizes, "output");
  return launch(c10d::OpType::ALLTOALL_BASE, "shardkit:all_to_all_single", {output}, opts,
                [this, output, input, dtype, send_counts, recv_counts]() mutable {
                  at::Tensor in = input.contiguous();
                  with_contiguous(output, [&](at::Tensor& out) {
                    group_->alltoall(in.data_ptr(), send_counts, offsets_of(send_counts), out.data_ptr(), recv_counts,
                                     offsets_of(recv_counts), dtype);
                  });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  if (multi_host()) return fallback("all_to_all").alltoall(outputs, inputs, opts);
  const char* op = "all_to_all";
  TORCH_CHECK(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
              args_.where(op), "expects one input and one output tensor per rank (", getSize(), "), got ",
              inputs.size(), " and ", outputs.size());
  const core::DType dtype = args_.check(inputs[0], op);
  std::vector<size_t> send_counts, recv_counts;
  for (int r = 0; r < getSize(); ++r) {
    args_.check(inputs[r], op);
    args_.check(outputs[r], op);
    args_.check_same(inputs[r], inputs[0], op);
    args_.check_same(outputs[r], inputs[0], op);
    send_counts.push_back(numel_of(inputs[r]));
    recv_counts.push_back(numel_of(outputs[r]));
  }
  return launch(c10d::OpType::ALLTOALL, "shardkit:all_to_all", outputs, opts,
                [this, outputs, inputs, dtype, send_counts, recv_counts]() mutable {
                  at::Tensor in = concat_flat(inputs);
                  const size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
                  at::Tensor out = at::empty({static_cast<int64_t>(total)}, inputs[0].options());
                  group_->alltoall(in.data_ptr(), send_counts, offsets_of(send_counts), out.data_ptr(), recv_counts,
                                   offsets_of(recv_counts), dtype);
                  split_flat(out, outputs);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::barrier(const c10d::BarrierOptions& opts) {
  return launch(c10d::OpType::BARRIER, "shardkit:barrier", {}, opts, [this] {
    group_->barrier();
    if (!multi_host()) return;
    if (inter_host_) wait_inner(inter_host_->barrier(), timeout_);
    group_->barrier();  // nobody leaves before every host's leader has passed the inter-host barrier
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  args_.check(args_.single(tensors, "send"), "send");
  TORCH_CHECK(fallback_, args_.where("send"), "point-to-point needs the inner gloo backend, which this group lacks");
  return fallback_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  args_.check(args_.single(tensors, "recv"), "recv");
  TORCH_CHECK(fallback_, args_.where("recv"), "point-to-point needs the inner gloo backend, which this group lacks");
  return fallback_->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  args_.check(args_.single(tensors, "recv"), "recv");
  TORCH_CHECK(fallback_, args_.where("recv"), "point-to-point needs the inner gloo backend, which this group lacks");
  return fallback_->recvAnysource(tensors, tag);
}

}  // namespace shardkit::comm

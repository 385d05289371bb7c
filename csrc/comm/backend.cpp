#include "comm/backend.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <typeinfo>

#include "comm/abort_cascade.h"
#include "compat.h"
#include "core/collective_identity.h"
#include "core/reduce.h"
#include "profile_span.h"
#ifdef SHARDKIT_WITH_CUDA
#include "comm/nccl/cuda_route.h"
#endif

namespace shardkit::comm {

namespace {

// AVG and PREMUL_SUM around an engine's reduction: scale the inputs first, divide the result after.
template <typename Reduce>
void reduce_with(const ReduceSpec& spec, at::Tensor& data, int world, bool result_here, Reduce reduce) {
  if (spec.premultiply) data.mul_(spec.factor);
  reduce(data);
  if (!spec.average || !result_here) return;
  if (data.is_cuda()) {  // on the op's stream; as the host routine: integer AVG truncates toward zero
    if (at::isFloatingType(data.scalar_type())) {
      data.div_(world);
    } else {
      data.div_(world, "trunc");
    }
    return;
  }
  core::divide_in_place(data.data_ptr(), data.numel(), core_dtype(data), world);
}

// allreduce as reduce_with does it, except that a host AVG goes to the engine whole (Engine::allreduce_average),
// which may divide inside the reduction instead of in a pass of its own.
void allreduce_with(const ReduceSpec& spec, at::Tensor& data, int world, Engine& engine, const OpContext& op) {
  if (spec.average && !data.is_cuda()) {
    if (spec.premultiply) data.mul_(spec.factor);
    engine.allreduce_average(op, data, world);
    return;
  }
  reduce_with(spec, data, world, true, [&](at::Tensor& d) { engine.allreduce(op, d, spec.op); });
}

bool any_cuda(const std::vector<at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.defined() && t.is_cuda(); });
}

}  // namespace

// Throws `error` again with `message` as its text, as the same kind of error where it is one of those the backend's
// ops throw (Python sees the same exception type); any other is rethrown as it was.
[[noreturn]] void rethrow_with(const std::exception& error, const std::string& message) {
  if (dynamic_cast<const std::invalid_argument*>(&error) != nullptr) throw std::invalid_argument(message);
  if (typeid(error) == typeid(std::runtime_error)) throw std::runtime_error(message);
  if (typeid(error) == typeid(c10::Error)) TORCH_CHECK(false, message);
  throw;
}

template <typename Body>
void ProcessGroupShardkit::run_failing_everywhere(uint64_t ticket, Body&& body) {
  try {
    body();
  } catch (const std::exception& error) {
    trace_->ended(ticket, false);
    const std::string message = message_of(error);
    // In the job's Store, or for an isolated group in its own (Config::isolated: FailureNotices was given none).
    notices_->record_deaths(engine_->take_exited_peers(), message);
    // This group's routes (no-op where one aborted itself: the first reason stands), then the process's others,
    // unless this group's failures stay its own.
    routes().abort(message);
    if (!config_.isolated) AbortCascade::abort_others(cascade_token_, message);
    const std::string note = trace_after_failure(message);
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (!first_failure_) first_failure_ = message + note;
    }
    if (note.empty()) throw;
    rethrow_with(error, message + note);
  }
  trace_->ended(ticket, true);
}

std::string ProcessGroupShardkit::trace_after_failure(const std::string& message) {
  if (trace_->capacity() == 0) return "";
  std::string path = trace_->failure_dump();
  if (path.empty()) {
    const std::string planned = trace_dir() + "/shardkit_trace_rank_" + std::to_string(ranks_.name(getRank()));
    if (trace_->claim_failure_dump(planned)) {
      try {
        TraceRegistry::dump_to(planned, message);
        std::cerr << "shardkit flight recorder (rank " << ranks_.name(getRank()) << "): trace written to " << planned
                  << std::endl;
      } catch (const std::exception& error) {
        return std::string(" [flight recorder: could not write this rank's trace: ") + message_of(error) + "]";
      }
    }
    path = trace_->failure_dump();
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return " [flight recorder: this rank's last collectives are in " + path + "; `python -m shardkit trace " + dir +
         "` compares the ranks']";
}

template <typename OpOptions, typename Body>
c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::launch(c10d::OpType type, const char* profiling_title,
                                                            const char* op, std::vector<at::Tensor> outputs,
                                                            const OpOptions& opts, Body body,
                                                            const std::vector<at::Tensor>& inputs,
                                                            const std::vector<at::Tensor>& traced_inputs) {
  const uint64_t issued = ++seq_;
  const uint64_t identity = core::current_identity();  // on the issuing thread: the op may run on the worker's
  const core::InterHostQuantization quantization = core::current_quantization();  // (the same)
  const bool compare_across_hosts = compare_across_hosts_.load();
  const bool cuda = any_cuda(outputs) || any_cuda(inputs);
  TORCH_CHECK(!cuda || quantization.exact(), args_.where(op),
              "quantized inter-host traffic (comm=shardkit.Quantized(...)) is not available for CUDA tensors yet; "
              "it runs on host tensors");
#ifdef SHARDKIT_WITH_CUDA
  std::shared_ptr<CudaReady> ready;  // CUDA ops: what the caller's stream queued before the op
  std::vector<c10::Device> devices;  // the CUDA future's devices: those of the outputs
  if (cuda) {
    std::vector<at::Tensor> tensors = outputs;
    tensors.insert(tensors.end(), inputs.begin(), inputs.end());
    ready = cuda_->ready_after(tensors, op, ranks_.name(getRank()));  // messages name the global rank
    if (any_cuda(outputs)) devices.push_back(ready->device);
  }
#else
  TORCH_INTERNAL_ASSERT(!cuda, "a CUDA tensor passed validation in a CPU build");
  const std::vector<c10::Device> devices;
#endif
  const std::chrono::milliseconds timeout = op_timeout(opts.timeout);
  const uint64_t ticket = trace_->issued(op, issued, identity, timeout,
                                         !traced_inputs.empty() ? traced_inputs : !inputs.empty() ? inputs : outputs,
                                         outputs);
  auto work = c10::make_intrusive<ShardkitWork>(getRank(), type, profiling_title, std::move(outputs), issued,
                                                devices);
  // Numbered again when it runs: collectives issued from future callbacks run at once (work_queue.h), so the
  // order in which ops run, not the order of the calls, is the one every rank shares. Messages and the shm
  // agreement check use that number.
#ifdef SHARDKIT_WITH_CUDA
  // A CUDA op's body (and the tensors it holds) lives until the op ends on the device: the watchdog keeps it.
  auto shared_body = std::make_shared<Body>(std::move(body));
  auto run = [this, op, timeout, identity, compare_across_hosts, quantization, shared_body, ready, work, ticket]() {
    const OpContext op_context = context(op, timeout, identity, compare_across_hosts, quantization);
    trace_->started(ticket, op_context.seq);
    if (ready) {  // CUDA tensors: NCCL, or host staging where NCCL cannot serve (comm/nccl/cuda_route.h); the
                  // recorder's "completed" is when the op is queued on the device
      run_failing_everywhere(ticket, [&] {
        cuda_->run(op_context, *ready, [&](Engine& engine) { (*shared_body)(engine, op_context); }, work,
                   shared_body);
      });
      return;
    }
    run_failing_everywhere(ticket, [&] { (*shared_body)(route(op_context), op_context); });
  };
#else
  auto run = [this, op, timeout, identity, compare_across_hosts, quantization, ticket,
              body = std::move(body)]() mutable {
    const OpContext op_context = context(op, timeout, identity, compare_across_hosts, quantization);
    trace_->started(ticket, op_context.seq);
    run_failing_everywhere(ticket, [&] { body(route(op_context), op_context); });
  };
#endif
  if (compat::is_async_op(opts)) {
    queue_.enqueue(work, std::move(run));
  } else {
    queue_.run_or_enqueue(work, std::move(run));
  }
  return work;
}

// --- reductions ------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  // torch sends sparse CPU tensors here (its SparseCPU kernel calls allreduce, not allreduce_sparse).
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduce_sparse_coo(tensors[0], opts);
  }
  at::Tensor tensor = args_.single(tensors, "allreduce");
  args_.check(tensor, "allreduce");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensor.scalar_type(), "allreduce");
  return launch(c10d::OpType::ALLREDUCE, "shardkit::allreduce", "allreduce", {tensor}, opts,
                [tensor, spec, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  with_contiguous(tensor, [&](at::Tensor& t) {
                    allreduce_with(spec, t, world, engine, op);
                  });
                });
}

void ProcessGroupShardkit::allreduce_now(at::Tensor& tensor, const c10d::ReduceOp& reduce_op,
                                         std::chrono::milliseconds timeout) {
  SHARDKIT_PROFILE_SPAN("shardkit::allreduce_now");
  TORCH_CHECK(tensor.defined() && !tensor.is_sparse() && tensor.device().is_cpu(), args_.where("allreduce"),
              "shardkit.all_reduce_ takes a dense CPU tensor, got ",
              tensor.defined() ? std::string(tensor.is_sparse() ? "a sparse tensor on " : "a tensor on ") +
                                     tensor.device().str()
                               : std::string("an undefined tensor"),
              "; use torch.distributed.all_reduce for it");
  args_.check(tensor, "allreduce");
  const ReduceSpec spec = args_.reduce_spec(reduce_op, tensor.scalar_type(), "allreduce");
  const uint64_t issued = ++seq_;
  const uint64_t identity = core::current_identity();
  const uint64_t ticket = trace_->issued("allreduce", issued, identity, op_timeout(timeout), {tensor}, {tensor});
  queue_.run_now([&] {
    const OpContext op_context = context("allreduce", op_timeout(timeout), identity, compare_across_hosts_.load(),
                                         core::current_quantization());
    trace_->started(ticket, op_context.seq);
    run_failing_everywhere(ticket, [&] {
      with_contiguous(tensor, [&](at::Tensor& t) { allreduce_with(spec, t, getSize(), route(op_context), op_context); });
    });
  });
}

at::Tensor ProcessGroupShardkit::shared_buffer(int64_t bytes, std::string* refused) {
  TORCH_CHECK(bytes >= 0, args_.where("shared_buffer"), "the size must be at least 0 bytes, got ", bytes);
  const uint64_t issued = ++seq_;
  const uint64_t ticket = trace_->issued("shared_buffer", issued, core::current_identity(),
                                         op_timeout(c10d::kUnsetTimeout), {}, {});
  at::Tensor out;
  queue_.run_now([&] {
    const OpContext context = this->context("shared_buffer", op_timeout(c10d::kUnsetTimeout), core::current_identity(),
                                            compare_across_hosts_.load(), core::InterHostQuantization{});
    trace_->started(ticket, context.seq);
    std::shared_ptr<core::SharedBuffer> buffer;
    run_failing_everywhere(ticket, [&] { buffer = engine_->share_buffer(context, static_cast<size_t>(bytes), refused); });
    if (!buffer) return;  // the caller tells the user why (python/shardkit/_zero_copy.py warns)
    // The tensor (and every view of it) keeps this rank's mapping alive.
    out = at::from_blob(
        buffer->mine(), {bytes}, [buffer](void*) mutable { buffer.reset(); }, at::TensorOptions().dtype(at::kByte));
  });
  return out;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                      const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse(), args_.where("allreduce_sparse"),
              "expects exactly one sparse COO tensor");
  return allreduce_sparse_coo(tensors[0], opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce_sparse_coo(const at::Tensor& tensor,
                                                                          const c10d::AllreduceOptions& opts) {
  const char* name = "allreduce";
  TORCH_CHECK(tensor.device().is_cpu(), args_.where(name), "sparse tensor is on ", tensor.device(),
              "; sparse allreduce runs on CPU tensors only");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, args_.where(name),
              "sparse tensors support reduce op SUM only (as gloo)");
  return launch(
      c10d::OpType::ALLREDUCE, "shardkit::allreduce", name, {tensor}, opts,
      [tensor, world = getSize()](Engine& engine, const OpContext& op) mutable {
        // Every rank contributes its (coalesced) indices and values; all ranks concatenate them in rank
        // order and coalesce, which sums duplicates: the same result, bit for bit, everywhere.
        const at::Tensor mine = tensor.coalesce();
        const at::Tensor indices = mine.indices().contiguous();
        const at::Tensor values = mine.values().contiguous();
        at::Tensor nnz = at::full({1}, mine._nnz(), at::kLong);
        at::Tensor all_nnz = at::empty({world}, at::kLong);
        engine.allgather(op, nnz, all_nnz);
        const int64_t most = all_nnz.max().item<int64_t>();
        auto gather_padded = [&](const at::Tensor& part, int64_t dim) {
          std::vector<int64_t> padded_shape = part.sizes().vec();
          padded_shape[dim] = most;
          at::Tensor padded = at::zeros(padded_shape, part.options());
          padded.narrow(dim, 0, part.size(dim)).copy_(part);
          padded_shape.insert(padded_shape.begin(), world);
          at::Tensor everyone = at::empty(padded_shape, part.options());
          at::Tensor everyone_bytes = as_bytes(everyone);
          engine.allgather(op, as_bytes(padded), everyone_bytes);
          std::vector<at::Tensor> pieces;
          for (int r = 0; r < world; ++r) pieces.push_back(everyone[r].narrow(dim, 0, all_nnz[r].item<int64_t>()));
          return at::cat(pieces, dim);
        };
        const at::Tensor all_indices = gather_padded(indices, 1);
        const at::Tensor all_values = gather_padded(values, 0);
        tensor.copy_(at::sparse_coo_tensor(all_indices, all_values, tensor.sizes(), tensor.options()).coalesce());
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                         const c10d::AllreduceCoalescedOptions& opts) {
  const char* name = "allreduce_coalesced";
  TORCH_CHECK(!tensors.empty(), args_.where(name), "got no tensors");
  args_.check(tensors[0], name);
  for (const auto& tensor : tensors) {
    args_.check(tensor, name);
    args_.check_same(tensor, tensors[0], name);
  }
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensors[0].scalar_type(), name);
  return launch(c10d::OpType::ALLREDUCE_COALESCED, "shardkit::allreduce_coalesced", name, tensors, opts,
                [tensors, spec, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  at::Tensor flat = concat_flat(tensors);
                  allreduce_with(spec, flat, world, engine, op);
                  split_flat(flat, tensors);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  at::Tensor tensor = args_.single(tensors, "reduce");
  args_.check(tensor, "reduce");
  args_.check_root(opts.rootRank, "reduce");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, tensor.scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::REDUCE, "shardkit::reduce", "reduce", {tensor}, opts,
                [tensor, spec, root, rank = getRank(), world = getSize()](Engine& engine, const OpContext& op) mutable {
                  auto run = [&](at::Tensor& d) { engine.reduce(op, d, spec.op, root); };
                  if (rank == root) {
                    with_contiguous(tensor, [&](at::Tensor& t) { reduce_with(spec, t, world, true, run); });
                  } else {
                    // Non-root tensors stay as they are: the engine only reads them; scaling needs a copy.
                    at::Tensor staged = spec.premultiply ? tensor.clone(at::MemoryFormat::Contiguous) : tensor.contiguous();
                    reduce_with(spec, staged, world, false, run);
                  }
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                                    const c10d::ReduceScatterOptions& opts) {
  at::Tensor output = args_.single(outputs, "reduce_scatter");
  args_.check(output, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, args_.where("reduce_scatter"), "expects one input list, got ", inputs.size());
  std::vector<at::Tensor> in = inputs[0];
  args_.check_per_rank(in, output, "reduce_scatter", "input_list");
  const ReduceSpec spec = args_.reduce_spec(opts.reduceOp, output.scalar_type(), "reduce_scatter");
  return launch(c10d::OpType::REDUCE_SCATTER, "shardkit::reduce_scatter", "reduce_scatter", {output}, opts,
                [output, in, spec, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  at::Tensor flat = concat_flat(in);
                  if (spec.premultiply) flat.mul_(spec.factor);
                  with_contiguous(output, [&](at::Tensor& out) {
                    reduce_with(spec.without_premultiply(), out, world, true,
                                [&](at::Tensor& o) { engine.reduce_scatter(op, flat, o, spec.op); });
                  });
                }, {}, in);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                          const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  TORCH_CHECK(outputs.size() == inputs.size(), args_.where(name), "got ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  std::vector<ReduceSpec> specs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    args_.check(inputs[i], name);
    args_.check(outputs[i], name);
    args_.check_same(outputs[i], inputs[i], name);
    args_.check_numel(inputs[i], outputs[i].numel() * getSize(), name, "input");
    specs.push_back(args_.reduce_spec(opts.reduceOp, inputs[i].scalar_type(), name));
  }
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, "shardkit::reduce_scatter_tensor", name, outputs, opts,
                [outputs, inputs, specs, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    const ReduceSpec& spec = specs[i];
                    at::Tensor in = spec.premultiply ? inputs[i].mul(spec.factor) : inputs[i].contiguous();
                    with_contiguous(outputs[i], [&](at::Tensor& out) {
                      reduce_with(spec.without_premultiply(), out, world, true,
                                  [&](at::Tensor& o) { engine.reduce_scatter(op, in, o, spec.op); });
                    });
                  }
                }, {}, inputs);
}

// --- data movement ---------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  at::Tensor tensor = args_.single(tensors, "broadcast");
  args_.check(tensor, "broadcast");
  args_.check_root(opts.rootRank, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  return launch(c10d::OpType::BROADCAST, "shardkit::broadcast", "broadcast", {tensor}, opts,
                [tensor, root](Engine& engine, const OpContext& op) mutable {
                  with_contiguous(tensor, [&](at::Tensor& t) { engine.broadcast(op, t, root); });
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  at::Tensor input = args_.single(inputs, "allgather");
  args_.check(input, "allgather");
  TORCH_CHECK(outputs.size() == 1, args_.where("allgather"), "expects one output list, got ", outputs.size());
  std::vector<at::Tensor> out = outputs[0];
  args_.check_per_rank(out, input, "allgather", "output_tensor_list");
  return launch(c10d::OpType::ALLGATHER, "shardkit::allgather", "allgather", out, opts,
                [input, out, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  at::Tensor flat = at::empty({input.numel() * world}, input.options());
                  engine.allgather(op, input.contiguous(), flat);
                  split_flat(flat, out);
                }, {}, std::vector<at::Tensor>{input});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output};
  std::vector<at::Tensor> inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor";
  TORCH_CHECK(outputs.size() == inputs.size(), args_.where(name), "got ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    args_.check(inputs[i], name);
    args_.check(outputs[i], name);
    args_.check_same(outputs[i], inputs[i], name);
    args_.check_numel(outputs[i], inputs[i].numel() * getSize(), name, "output");
  }
  return launch(c10d::OpType::_ALLGATHER_BASE, "shardkit::all_gather_into_tensor", name, outputs, opts,
                [outputs, inputs](Engine& engine, const OpContext& op) mutable {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    const at::Tensor in = inputs[i].contiguous();
                    with_contiguous(outputs[i], [&](at::Tensor& out) { engine.allgather(op, in, out); });
                  }
                }, {}, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_coalesced";
  TORCH_CHECK(static_cast<int>(output_lists.size()) == getSize(), args_.where(name),
              "expects one output list per rank (", getSize(), "), got ", output_lists.size());
  int64_t bytes = 0;
  for (const auto& input : inputs) {
    args_.check(input, name);
    args_.check_same_device(input, inputs[0], name);  // any dtypes, one device
    bytes += input.numel() * static_cast<int64_t>(input.element_size());
  }
  std::vector<at::Tensor> flat_outputs;  // rank r's list, then rank r+1's: the order of the gathered bytes
  for (size_t r = 0; r < output_lists.size(); ++r) {
    TORCH_CHECK(output_lists[r].size() == inputs.size(), args_.where(name), "output list ", r, " has ",
                output_lists[r].size(), " tensors, expected ", inputs.size(), " (one per input)");
    for (size_t i = 0; i < inputs.size(); ++i) {
      args_.check(output_lists[r][i], name);
      args_.check_same(output_lists[r][i], inputs[i], name);
      args_.check_numel(output_lists[r][i], inputs[i].numel(), name, "output");
      flat_outputs.push_back(output_lists[r][i]);
    }
  }
  // Tensors of any dtypes travel together as bytes.
  return launch(c10d::OpType::ALLGATHER_COALESCED, "shardkit::all_gather_coalesced", name, flat_outputs, opts,
                [inputs, flat_outputs, bytes, world = getSize()](Engine& engine, const OpContext& op) mutable {
                  std::vector<at::Tensor> parts;
                  for (const auto& input : inputs) parts.push_back(as_bytes(input.contiguous()));
                  const at::Tensor mine = parts.empty() ? at::empty({0}, at::kByte) : at::cat(parts);
                  at::Tensor everyone = at::empty({bytes * world}, mine.options());  // on the inputs' device
                  engine.allgather(op, mine, everyone);
                  int64_t offset = 0;
                  for (auto& out : flat_outputs) {
                    const int64_t n = out.numel() * static_cast<int64_t>(out.element_size());
                    out.view({-1}).copy_(everyone.narrow(0, offset, n).view(out.scalar_type()));
                    offset += n;
                  }
                }, {}, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::GatherOptions& opts) {
  at::Tensor input = args_.single(inputs, "gather");
  args_.check(input, "gather");
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
  return launch(c10d::OpType::GATHER, "shardkit::gather", "gather", out, opts,
                [input, out, root, rank = getRank(), world = getSize()](Engine& engine, const OpContext& op) mutable {
                  at::Tensor flat;
                  if (rank == root) flat = at::empty({input.numel() * world}, input.options());
                  engine.gather(op, input.contiguous(), flat, root);
                  if (flat.defined()) split_flat(flat, out);
                }, {input});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  at::Tensor output = args_.single(outputs, "scatter");
  args_.check(output, "scatter");
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
  return launch(c10d::OpType::SCATTER, "shardkit::scatter", "scatter", {output}, opts,
                [output, in, root](Engine& engine, const OpContext& op) mutable {
                  const at::Tensor flat = in.empty() ? at::Tensor() : concat_flat(in);
                  with_contiguous(output, [&](at::Tensor& out) { engine.scatter(op, flat, out, root); });
                }, {}, in);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                   std::vector<int64_t>& output_split_sizes,
                                                                   std::vector<int64_t>& input_split_sizes,
                                                                   const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  args_.check(input, name);
  args_.check(output, name);
  args_.check_same(output, input, name);
  const std::vector<size_t> send_counts = args_.split_counts(input, input_split_sizes, name, "input");
  const std::vector<size_t> recv_counts = args_.split_counts(output, output_split_sizes, name, "output");
  TORCH_CHECK(send_counts[getRank()] == recv_counts[getRank()], args_.where(name), "this rank sends ",
              send_counts[getRank()], " elements to itself but expects to receive ", recv_counts[getRank()],
              " from itself (input and output split sizes disagree at index ", getRank(), ")");
  return launch(c10d::OpType::ALLTOALL_BASE, "shardkit::all_to_all_single", name, {output}, opts,
                [output, input, send_counts, recv_counts](Engine& engine, const OpContext& op) mutable {
                  const at::Tensor in = input.contiguous();
                  with_contiguous(output, [&](at::Tensor& out) {
                    engine.alltoall(op, in, send_counts, out, recv_counts);
                  });
                }, {}, std::vector<at::Tensor>{input});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  TORCH_CHECK(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
              args_.where(name), "expects one input and one output tensor per rank (", getSize(), "), got ",
              inputs.size(), " and ", outputs.size());
  args_.check(inputs[0], name);
  std::vector<size_t> send_counts, recv_counts;
  for (int r = 0; r < getSize(); ++r) {
    args_.check(inputs[r], name);
    args_.check(outputs[r], name);
    args_.check_same(inputs[r], inputs[0], name);
    args_.check_same(outputs[r], inputs[0], name);
    send_counts.push_back(numel_of(inputs[r]));
    recv_counts.push_back(numel_of(outputs[r]));
  }
  TORCH_CHECK(send_counts[getRank()] == recv_counts[getRank()], args_.where(name), "this rank sends ",
              send_counts[getRank()], " elements to itself but expects to receive ", recv_counts[getRank()],
              " from itself (input_tensor_list and output_tensor_list disagree at index ", getRank(), ")");
  return launch(c10d::OpType::ALLTOALL, "shardkit::all_to_all", name, outputs, opts,
                [outputs, inputs, send_counts, recv_counts](Engine& engine, const OpContext& op) mutable {
                  const at::Tensor in = concat_flat(inputs);
                  const size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
                  at::Tensor out = at::empty({static_cast<int64_t>(total)}, inputs[0].options());
                  engine.alltoall(op, in, send_counts, out, recv_counts);
                  split_flat(out, outputs);
                }, {}, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::barrier(const c10d::BarrierOptions& opts) {
  return launch(c10d::OpType::BARRIER, "shardkit::barrier", "barrier", {}, opts,
                [](Engine& engine, const OpContext& op) { engine.barrier(op); });
}

// --- through the inner gloo backend ----------------------------------------------------------------------

void ProcessGroupShardkit::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  inner_->all_ranks(args_.where("monitored_barrier"))->monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  args_.check(args_.single(tensors, "send"), "send");
  refuse_cuda_point_to_point(tensors, "send");
  LocalPointToPoint::check_tag(tag, args_.where("send"));
  if (local_p2p_->direct(tensors[0], dst_rank)) {
    return track_point_to_point(local_p2p_->send(tensors[0], dst_rank, tag, args_.where("send")));
  }
  return track_point_to_point(inner_->all_ranks(args_.where("send"))->send(tensors, dst_rank, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  args_.check(args_.single(tensors, "recv"), "recv");
  refuse_cuda_point_to_point(tensors, "recv");
  LocalPointToPoint::check_tag(tag, args_.where("recv"));
  if (local_p2p_->direct(tensors[0], src_rank)) {
    return track_point_to_point(local_p2p_->recv(tensors[0], src_rank, tag, args_.where("recv")));
  }
  return track_point_to_point(inner_->all_ranks(args_.where("recv"))->recv(tensors, src_rank, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  args_.check(args_.single(tensors, "recv"), "recv");
  refuse_cuda_point_to_point(tensors, "recv");
  LocalPointToPoint::check_tag(tag, args_.where("recv"));
  if (local_p2p_->direct_from_any(tensors[0], args_.where("recv"))) {
    return track_point_to_point(local_p2p_->recv(tensors[0], -1, tag, args_.where("recv")));
  }
  return track_point_to_point(inner_->all_ranks(args_.where("recv"))->recvAnysource(tensors, tag));
}

void ProcessGroupShardkit::refuse_cuda_point_to_point(const std::vector<at::Tensor>& tensors, const char* op) const {
  TORCH_CHECK(!any_cuda(tensors), args_.where(op), "point-to-point ", op, " of CUDA tensors is not supported yet "
              "(it goes to the inner gloo backend, which takes CPU tensors); copy the tensor to the CPU first");
}

}  // namespace shardkit::comm

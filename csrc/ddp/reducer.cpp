#include "ddp/reducer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <limits>

#include "core/bucket_assignment.h"
#include "core/collective_identity.h"
#include "profile_span.h"
#ifdef SHARDKIT_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace shardkit::ddp {

namespace {

// Parameters of different dtypes or devices never share a bucket.
int64_t bucket_group(const at::Tensor& param) {
  return static_cast<int64_t>(param.scalar_type()) * 1000 + static_cast<int64_t>(param.device().index() + 1) * 10 +
         static_cast<int64_t>(param.device().type());
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options)
    : params_(std::move(params)),
      names_(std::move(names)),
      process_group_(std::move(process_group)),
      options_(options),
      ready_(params_.size(), false) {
  TORCH_CHECK(names_.size() == params_.size(), where(), "got ", names_.size(), " names for ", params_.size(),
              " parameters");
  TORCH_CHECK(!params_.empty(), where(), "the module has no parameters that require gradients");
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& param = params_[i];
    TORCH_CHECK(param.requires_grad(), where(), "parameter ", names_[i], " does not require grad");
    TORCH_CHECK(param.layout() == at::kStrided, where(), "parameter ", names_[i], " is not dense (sparse gradients "
                "are not supported by shardkit DDP)");
  }
  TORCH_CHECK(!(options_.shard_gradients && options_.gradient_as_bucket_view), where(),
              "gradient_as_bucket_view=True cannot be combined with zero_stage=2: ZeRO-2 keeps no whole gradients "
              "(each rank keeps only its shard), so there are no .grad tensors to make bucket views");
  // The first iteration's layout follows torch's DDP: buckets filled in registration order, launched last
  // bucket first (gradients arrive roughly in reverse). Unless unused parameters must be expected, that
  // first layout is one bucket per dtype, and the real one is built from the observed arrival order.
  std::vector<size_t> forward(params_.size());
  for (size_t i = 0; i < forward.size(); ++i) forward[i] = i;
  const size_t unbounded = std::numeric_limits<size_t>::max();
  auto initial = options_.find_unused_parameters
                     ? core::assign_buckets(param_shapes(), forward, options_.first_bucket_bytes, options_.bucket_bytes_cap)
                     : core::assign_buckets(param_shapes(), forward, unbounded, unbounded);
  std::reverse(initial.begin(), initial.end());
  build_buckets(initial);

  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(accumulator, where(), "parameter ", names_[i], " has no gradient accumulator (is it a leaf?)");
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          std::lock_guard<std::mutex> lock(mutex_);
          mark_ready(i);
          return outputs;
        }));
    hooks_.emplace_back(std::move(accumulator), key);
  }
}

Reducer::~Reducer() {
  for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
}

std::string Reducer::where() const {
  return "shardkit DDP (rank " + std::to_string(process_group_->getRank()) + "): ";
}

std::vector<core::BucketParam> Reducer::param_shapes() const {
  std::vector<core::BucketParam> shapes;
  shapes.reserve(params_.size());
  for (const auto& param : params_) {
    shapes.push_back({static_cast<size_t>(param.numel()) * param.element_size(), bucket_group(param)});
  }
  return shapes;
}

void Reducer::build_buckets(const std::vector<std::vector<size_t>>& assignment) {
  // Built aside and adopted together at the end: place_in_shared_buffer is a collective and may throw, and the
  // old layout must then stay whole.
  std::vector<Bucket> buckets(assignment.size());
  std::vector<Slot> slots(params_.size(), Slot{});
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.members = assignment[b];
    if (shards_) shards_->sort_members(bucket.members);
    size_t total = 0;
    for (size_t position = 0; position < bucket.members.size(); ++position) {
      const size_t index = bucket.members[position];
      bucket.offsets.push_back(total);
      bucket.lengths.push_back(static_cast<size_t>(params_[index].numel()));
      total += bucket.lengths.back();
      slots[index] = {b, position};
    }
    if (shards_) bucket.owners = shards_->owner_ranges(bucket.members, bucket.offsets, bucket.lengths);
    std::string members;
    for (size_t index : bucket.members) members += names_[index] + ",";
    bucket.identity = core::identity_of("DDP bucket " + std::to_string(b) + " of " + std::to_string(assignment.size()) +
                                            " (" + std::to_string(bucket.members.size()) + " parameters, " +
                                            std::to_string(total) + " elements)",
                                        members);
  }
  const bool zero_copy = place_in_shared_buffer(buckets);
  for (Bucket& bucket : buckets) {
    // Under ZeRO-2 buffers exist only during a backward (bucket_view() allocates them).
    if (!options_.shard_gradients && !bucket.buffer.defined()) bucket.buffer = allocate_buffer(bucket);
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  zero_copy_ = zero_copy;
  if (options_.gradient_as_bucket_view) {
    // Gradients become views of their bucket slices, keeping whatever they held.
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor view = bucket_view(i);
      at::Tensor& grad = params_[i].mutable_grad();
      if (grad.defined()) view.copy_(grad);
      grad = view;
    }
  }
}

bool Reducer::place_in_shared_buffer(std::vector<Bucket>& buckets) {
  // Every rank decides alike (same options, same parameters' devices), so either all call the collective or none.
  if (!options_.shared_buffer || !options_.gradient_as_bucket_view || options_.shard_gradients) return false;
  if (std::any_of(params_.begin(), params_.end(), [](const at::Tensor& p) { return !p.device().is_cpu(); })) return false;
  constexpr int64_t kAlign = 64;  // each bucket on its own cache lines
  std::vector<int64_t> starts, sizes;  // bytes
  int64_t total = 0;
  for (const Bucket& bucket : buckets) {
    starts.push_back(total);
    sizes.push_back(static_cast<int64_t>(bucket.numel()) * params_[bucket.members.front()].element_size());
    total += (sizes.back() + kAlign - 1) / kAlign * kAlign;
  }
  const at::Tensor shared = options_.shared_buffer(total);
  if (!shared.defined()) return false;
  // Fresh shared memory reads as zeros, as allocate_buffer's persistent buffers start.
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets[b].buffer = shared.narrow(0, starts[b], sizes[b]).view(params_[buckets[b].members.front()].scalar_type());
  }
  return true;
}

at::Tensor Reducer::allocate_buffer(const Bucket& bucket) const {
  const size_t total = bucket.numel();
  const auto options = params_[bucket.members.front()].options().requires_grad(false);
  // ZeRO-2 allocates each backward and every element is written before the bucket launches (a gradient,
  // or zeros for an unused parameter): no zero-fill pass. Persistent buffers start as zeros.
  return options_.shard_gradients ? at::empty({static_cast<int64_t>(total)}, options)
                                  : at::zeros({static_cast<int64_t>(total)}, options);
}

at::Tensor Reducer::bucket_view(size_t index) {
  const Slot& slot = slots_[index];
  Bucket& bucket = buckets_[slot.bucket];
  if (!bucket.buffer.defined()) bucket.buffer = allocate_buffer(bucket);
  return bucket.buffer.narrow(0, static_cast<int64_t>(bucket.offsets[slot.position]),
                              static_cast<int64_t>(bucket.lengths[slot.position]))
      .view(params_[index].sizes());
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : buckets_) out.push_back(bucket.members);
  return out;
}

void Reducer::load_bucket_indices(const std::vector<std::vector<size_t>>& assignment) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!callback_queued_, where(), "load_bucket_layout during a backward");
  std::vector<int> seen(params_.size(), 0);
  for (size_t b = 0; b < assignment.size(); ++b) {
    TORCH_CHECK(!assignment[b].empty(), where(), "load_bucket_layout: bucket ", b, " is empty");
    for (size_t index : assignment[b]) {
      TORCH_CHECK(index < params_.size(), where(), "load_bucket_layout: bucket ", b, " names parameter ", index,
                  " but the model has ", params_.size());
      TORCH_CHECK(++seen[index] == 1, where(), "load_bucket_layout: parameter ", names_[index],
                  " appears more than once");
      TORCH_CHECK(bucket_group(params_[index]) == bucket_group(params_[assignment[b].front()]), where(),
                  "load_bucket_layout: bucket ", b, " mixes dtypes or devices (", names_[index], ")");
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(seen[i] == 1, where(), "load_bucket_layout: parameter ", names_[i], " is in no bucket");
  }
  build_buckets(assignment);
  rebuilt_ = true;
}

std::vector<at::Tensor> Reducer::bucket_buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) {
    if (bucket.buffer.defined()) out.push_back(bucket.buffer);
  }
  return out;
}

void Reducer::set_gradient_shards(std::vector<core::FlatLayout> layouts, std::vector<at::Tensor> shards,
                                  std::vector<int64_t> space, std::vector<int64_t> slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(options_.shard_gradients, where(), "gradient shards are only used with zero_stage=2");
  TORCH_CHECK(shards_ == nullptr, where(), "zero_stage=2: the gradient shards are already set; the partition is "
              "fixed when the DDP is built");
  TORCH_CHECK(!callback_queued_, where(), "zero_stage=2: gradient shards set during a backward");
  shards_ = std::make_unique<GradientShards>(params_, names_, std::move(layouts), std::move(shards), std::move(space),
                                             std::move(slot), process_group_->getRank(), process_group_->getSize(),
                                             where());
  build_buckets(bucket_indices());  // the same buckets, members now in flat order, owners known
}

std::vector<bool> Reducer::shard_gradient_defined() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(shards_ != nullptr, where(), "no gradient shards: only a zero_stage=2 reducer has them");
  return shards_->defined();
}

void Reducer::clear_gradient_shards(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shards_) shards_->clear(set_to_none);
}

void Reducer::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(comm_hook_ == nullptr, where(),
              "register_comm_hook or register_builtin_comm_hook can only be called once.");
  comm_hook_ = std::move(hook);
}

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!callback_queued_, where(), "the previous backward has not finished its gradient reduction");
  // The DDP sets the shards right after building the reducer; only a direct user of _C.Reducer can miss it.
  TORCH_CHECK(!options_.shard_gradients || shards_, where(), "zero_stage=2 reducer without gradient shards: call "
              "set_gradient_shards before the first synchronised backward");
  rebuild_buckets_if_due();
  reset_iteration();
  armed_ = true;
}

void Reducer::rebuild_buckets_if_due() {
  if (iteration_ != 1 || rebuilt_ || options_.find_unused_parameters) return;
  SHARDKIT_PROFILE_SPAN("shardkit::ddp.rebuild_buckets");
  // Rebuild once from the arrival order of the first iteration; rank 0's order wins so that every rank
  // builds identical buckets (they launch collectives bucket by bucket). Parameters that never arrived
  // keep their reverse-registration place at the end.
  std::vector<size_t> order = arrival_order_;
  std::vector<bool> present(params_.size(), false);
  for (size_t index : order) present[index] = true;
  for (size_t i = params_.size(); i-- > 0;) {
    if (!present[i]) order.push_back(i);
  }
  at::Tensor agreed = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
  int64_t* slots = agreed.data_ptr<int64_t>();
  for (size_t i = 0; i < order.size(); ++i) slots[i] = static_cast<int64_t>(order[i]);
  std::vector<at::Tensor> payload{agreed};
  process_group_->broadcast(payload)->wait();
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<size_t>(slots[i]);
  build_buckets(core::assign_buckets(param_shapes(), order, options_.first_bucket_bytes, options_.bucket_bytes_cap));
  rebuilt_ = true;
}

void Reducer::set_divisor_for_this_backward(double ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(armed_, where(), "set_divisor_for_this_backward: no synchronised backward is prepared");
  TORCH_CHECK(ranks >= 1 && ranks <= process_group_->getSize(), where(), "the divisor must count between 1 and ",
              process_group_->getSize(), " ranks, got ", ranks);
  divisor_ = ranks;
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!callback_queued_, where(), "the previous backward has not finished its gradient reduction");
  TORCH_CHECK(!options_.shard_gradients, where(), "join() is not supported with zero_stage=2");
  SHARDKIT_PROFILE_SPAN("shardkit::ddp.join_shadow_backward");
  rebuild_buckets_if_due();
  reset_iteration();
  // Zeros to reduce, in the buckets themselves: a zero-copy bucket must stay where it is (the other ranks
  // reduce in the shared buffer, at its offset, and the op header says so). What they hold may be this rank's
  // .grad (gradient_as_bucket_view), which must survive: saved, and put back afterwards.
  std::vector<at::Tensor> real;
  for (Bucket& bucket : buckets_) {
    real.push_back(bucket.buffer.clone());
    bucket.buffer.zero_();
    bucket.pending = 0;
  }
  launch_ready_buckets();
  std::exception_ptr failure;
  try {
    wait_for_bucket_futures();
    if (options_.find_unused_parameters) agree_on_used(at::zeros({static_cast<int64_t>(params_.size())}, at::kInt));
  } catch (...) {
    failure = std::current_exception();
  }
  for (size_t i = 0; i < buckets_.size(); ++i) buckets_[i].buffer.copy_(real[i]);
  reset_iteration();
  if (failure) std::rethrow_exception(failure);
  ++iteration_;
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.members.size();
    bucket.futures.clear();
  }
  next_launch_ = 0;
  armed_ = false;
  callback_queued_ = false;
  divisor_ = 0;
}

void Reducer::mark_ready(size_t index) {
  if (!armed_) return;  // no_sync(), eval-mode backward, or a backward DDP's forward did not prepare
  TORCH_CHECK(!ready_[index], where(), "parameter ", names_[index],
              " received its gradient twice in one backward; shardkit DDP supports one backward per forward");
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  ready_[index] = true;
  if (iteration_ == 0) arrival_order_.push_back(index);

  at::Tensor view = bucket_view(index);
  at::Tensor& grad = params_[index].mutable_grad();
  if (options_.gradient_as_bucket_view) {
    if (!grad.defined() || !grad.is_alias_of(view)) {  // e.g. grads were set to None by zero_grad()
      if (grad.defined()) view.copy_(grad);
      grad = view;
    }
  } else {
    view.copy_(grad);
    if (shards_) grad.reset();  // ZeRO-2: the bucket holds it now; only the owned shard outlives backward
  }
  Bucket& bucket = buckets_[slots_[index].bucket];
  if (--bucket.pending == 0) launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(next_launch_++);
}

void Reducer::launch(size_t bucket_index) {
  SHARDKIT_PROFILE_SPAN("shardkit::ddp.bucket[" + std::to_string(bucket_index) + "]");
  Bucket& bucket = buckets_[bucket_index];
  // The reducer's own collectives carry the bucket's identity; a comm hook's carry none: a hook may issue some from
  // a future callback, which runs here (inline) on one rank and on a worker thread on another.
  core::IdentityScope identity(comm_hook_ ? 0 : bucket.identity);
  core::QuantizationScope quantization(comm_hook_ ? core::InterHostQuantization{} : quantization_);
  bucket.averaged = false;
  if (comm_hook_) {
    std::vector<c10::IntArrayRef> sizes;
    std::vector<at::Tensor> members;
    for (size_t index : bucket.members) {
      sizes.push_back(params_[index].sizes());
      members.push_back(params_[index]);
    }
    c10d::GradBucket grad_bucket(bucket_index, buckets_.size(), bucket.buffer, bucket.offsets, bucket.lengths, sizes,
                                 members, std::nullopt);
    bucket.futures.push_back(comm_hook_->runHook(grad_bucket));
  } else if (shards_) {
    for (const auto& owner : bucket.owners) {  // every rank issues the same reduces in the same order
      std::vector<at::Tensor> payload{
          bucket.buffer.narrow(0, static_cast<int64_t>(owner.begin), static_cast<int64_t>(owner.length))};
      c10d::ReduceOptions to_owner;
      to_owner.rootRank = owner.rank;
      bucket.futures.push_back(process_group_->reduce(payload, to_owner)->getFuture());
    }
  } else {
    std::vector<at::Tensor> payload{bucket.buffer};
    c10d::AllreduceOptions opts;
    // Zero-copy buckets are averaged by the engine, inside the reduction (each slice divided once, before it is
    // shared: no pass of its own over the bucket). Only there: gloo has no AVG. Every rank decides alike (the
    // join hook sets engine_average_ on all ranks; divisor_ is set only when it is off).
    bucket.averaged = zero_copy_ && engine_average_ && divisor_ == 0;
    if (bucket.averaged) opts.reduceOp = c10d::ReduceOp::AVG;
    bucket.futures.push_back(process_group_->allreduce(payload, opts)->getFuture());
  }
}

void Reducer::finalize() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!armed_) return;
  SHARDKIT_PROFILE_SPAN("shardkit::ddp.finalize");
  at::Tensor used;  // find_unused_parameters: 1 where this rank used the parameter
  if (options_.find_unused_parameters) {
    // Unused here: contribute zeros, so that ranks that did use the parameter get the right average.
    used = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) {
        used[static_cast<int64_t>(i)] = 1;
        continue;
      }
      bucket_view(i).zero_();
      ready_[i] = true;
      Bucket& bucket = buckets_[slots_[i].bucket];
      if (--bucket.pending == 0) launch_ready_buckets();
    }
  } else {
    std::string missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) missing += (missing.empty() ? "" : ", ") + names_[i];
    }
    if (!missing.empty()) {
      reset_iteration();
      TORCH_CHECK(false, where(), "parameters that were not used in producing the loss got no gradient: [", missing,
                  "]. Pass find_unused_parameters=True to shardkit.DistributedDataParallel if your model has "
                  "parameters that a forward pass may not use; otherwise make every parameter take part in the loss.");
    }
  }
  TORCH_INTERNAL_ASSERT(next_launch_ == buckets_.size(), "only ", next_launch_, " of ", buckets_.size(),
                        " buckets were launched");

  wait_for_bucket_futures();
  const std::vector<int32_t> globally_used = used.defined() ? agree_on_used(used) : std::vector<int32_t>{};
  for (Bucket& bucket : buckets_) {
    const bool average = comm_hook_ == nullptr;  // a hook does its own division, as in torch
    at::Tensor result = average ? bucket.buffer : comm_hook_->parseHookResult(bucket.futures.front()->value());
    finalize_bucket(bucket, result, average, globally_used);
  }
  ++iteration_;
  reset_iteration();
}

void Reducer::wait_for_bucket_futures() {
  // Every bucket's reduction must be over before anything else is issued: a comm hook may still issue
  // collectives from its callbacks until its future completes, and every rank must issue collectives in
  // the same order (docs/design.md, "Collective order"). A failed reduction (a peer died, the group aborted)
  // fails this backward; the error is taken before reset_iteration() drops the futures that hold it.
  std::exception_ptr failure;
  for (Bucket& bucket : buckets_) {
    for (const auto& future : bucket.futures) {
      future->wait();
      if (future->hasError() && !failure) failure = future->exception_ptr();
    }
  }
  if (failure) {
    reset_iteration();
    std::rethrow_exception(failure);
  }
}

std::vector<int32_t> Reducer::agree_on_used(at::Tensor used) {
  std::vector<at::Tensor> payload{used};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  auto work = process_group_->allreduce(payload, max);
  try {
    work->wait();
  } catch (...) {
    reset_iteration();
    throw;
  }
  return std::vector<int32_t>(used.data_ptr<int32_t>(), used.data_ptr<int32_t>() + used.numel());
}

#ifdef SHARDKIT_WITH_CUDA
bool Reducer::unpack_to_grads(Bucket& bucket, const at::Tensor& result, double factor) {
  std::vector<at::Tensor> grads;
  std::vector<int64_t> offsets;
  for (size_t position = 0; position < bucket.members.size(); ++position) {
    const at::Tensor& param = params_[bucket.members[position]];
    const at::Tensor& grad = param.grad();
    if (grad.defined() && (!grad.is_contiguous() || grad.scalar_type() != result.scalar_type())) return false;
    grads.push_back(grad);
    offsets.push_back(static_cast<int64_t>(bucket.offsets[position]));
  }
  for (size_t position = 0; position < bucket.members.size(); ++position) {
    at::Tensor& grad = params_[bucket.members[position]].mutable_grad();
    if (!grad.defined()) grad = grads[position] = at::empty(params_[bucket.members[position]].sizes(), result.options());
  }
  cuda::unpack_(result.is_contiguous() ? result : result.contiguous(), grads, offsets, factor);
  return true;
}
#endif

void Reducer::finalize_bucket(Bucket& bucket, const at::Tensor& result, bool average,
                              const std::vector<int32_t>& globally_used) {
  SHARDKIT_PROFILE_SPAN("shardkit::ddp.copy_bucket_to_grad[" + std::to_string(&bucket - buckets_.data()) + "]");
  const double ranks = divisor_ > 0 ? divisor_ : static_cast<double>(process_group_->getSize());
#ifdef SHARDKIT_WITH_CUDA
  if (result.is_cuda() && !shards_ && !options_.gradient_as_bucket_view && globally_used.empty() &&
      unpack_to_grads(bucket, result, average ? 1.0 / ranks : 1.0)) {
    return;
  }
#endif
  const at::Tensor divisor = average ? at::scalar_tensor(ranks, result.options()) : at::Tensor();
  if (options_.gradient_as_bucket_view) {
    if (!result.is_same(bucket.buffer)) bucket.buffer.copy_(result);
    if (average && !bucket.averaged) bucket.buffer.div_(ranks);
  }
  for (size_t position = 0; position < bucket.members.size(); ++position) {
    const size_t index = bucket.members[position];
    if (!globally_used.empty() && globally_used[index] == 0) continue;  // unused everywhere: .grad untouched
    at::Tensor reduced = result.narrow(0, static_cast<int64_t>(bucket.offsets[position]),
                                       static_cast<int64_t>(bucket.lengths[position]));
    if (shards_) {
      shards_->take(index, reduced, divisor);  // reads only this rank's share, the part its reduce filled
      continue;
    }
    at::Tensor& grad = params_[index].mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!grad.defined()) grad = bucket_view(index);
      continue;
    }
    reduced = reduced.view(params_[index].sizes());
    if (!grad.defined()) grad = at::empty_like(params_[index]);
    if (average) {
      at::div_out(grad, reduced, divisor);  // copy-back fused with the average
    } else {
      grad.copy_(reduced);
    }
  }
  if (shards_) bucket.buffer = at::Tensor();  // ZeRO-2: buffers live only during backward
}

}  // namespace shardkit::ddp

#include "fsdp/flat_param.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <utility>

#include "compat.h"
#include "core/collective_identity.h"
#include "fsdp/cast.h"

namespace shardkit::fsdp {

namespace {

// Frees a tensor's memory but keeps its storage object, so every tensor sharing that storage (autograd's
// saved views) sees the memory again after restore_storage().
void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

// Allocates on the tensor's device (the CUDA caching allocator serves the current device, and ties the block to
// that device's current stream: the caller's compute stream).
void restore_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes) return;
  TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr, "FSDP full buffer without an allocator");
  const c10::DeviceGuard device_guard(tensor.device());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

void wait_or_explain(const c10::intrusive_ptr<c10d::Work>& work, const std::string& where) {
  try {
    work->wait();
  } catch (const std::exception& error) {
    TORCH_CHECK(false, where, error.what());
  }
}

}  // namespace

FlatParamHandle::FlatParamHandle(const std::vector<at::Tensor>& params,
                                 c10::intrusive_ptr<c10d::ProcessGroup> shard_group,
                                 c10::intrusive_ptr<c10d::ProcessGroup> replicate_group, Options options)
    : shard_group_(std::move(shard_group)), replicate_group_(std::move(replicate_group)), options_(std::move(options)) {
  rank_ = shard_group_ ? shard_group_->getRank() : 0;
  TORCH_CHECK(!params.empty(), where("flatten"), "no parameters to flatten");
  const at::Tensor& first = params.front();
  std::vector<int64_t> numels;
  for (const at::Tensor& p : params) {
    TORCH_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(), where("flatten"),
                "parameters of one flat parameter must share dtype and device; got ", p.scalar_type(), " on ",
                p.device(), " beside ", first.scalar_type(), " on ", first.device());
    shapes_.push_back(p.sizes().vec());
    numels.push_back(p.numel());
  }
  compute_dtype_ = options_.param_dtype.value_or(first.scalar_type());
  reduce_dtype_ = options_.reduce_dtype.value_or(compute_dtype_);
  const int64_t element = static_cast<int64_t>(c10::elementSize(compute_dtype_));
  layout_ = core::FlatLayout(std::move(numels), shard_world(), std::max<int64_t>(1, options_.alignment_bytes / element));
  std::string shapes;
  for (const auto& shape : shapes_) shapes += c10::str(c10::IntArrayRef(shape));
  identity_ = core::identity_of("FSDP unit '" + options_.label + "' (" + std::to_string(params.size()) +
                                    " parameters, " + std::to_string(layout_.param_numel()) + " " +
                                    c10::toString(first.scalar_type()) + " elements)",
                                shapes);

  if (options_.compute_device) {
    offload_ = std::make_unique<HostOffload>(*options_.compute_device, where("cpu_offload"));
    TORCH_CHECK(first.is_cpu() || first.device() == offload_->device(), where("cpu_offload"), "the parameters are on ",
                first.device(), ", neither on the CPU nor on the compute device ", offload_->device());
    // Pinned: the copy-in and copy-out are DMA transfers that need not wait for the host.
    shard_ = at::empty({layout_.shard_numel()},
                       first.options().device(at::kCPU).requires_grad(false).pinned_memory(true));
    shard_.zero_();  // the padding and alignment gaps
  } else {
    shard_ = at::zeros({layout_.shard_numel()}, first.options().requires_grad(false));
  }
  {
    at::NoGradGuard no_grad;
    for (const core::FlatPiece& piece : layout_.pieces_of_rank(rank_)) {
      shard_.narrow(0, piece.shard_begin, piece.numel)
          .copy_(params[piece.param].detach().reshape(-1).narrow(0, piece.param_begin, piece.numel));
    }
  }
  full_is_shard_ = !offload_ && shard_world() == 1 && compute_dtype_ == first.scalar_type();
  if (full_is_shard_) {
    full_ = shard_;
    state_ = State::kUnsharded;
  } else {
    full_ = at::empty({layout_.padded_numel()}, shard_.options().dtype(compute_dtype_).device(full_device()));
    release_storage(full_);
  }
}

at::Device FlatParamHandle::full_device() const { return offload_ ? offload_->device() : shard_.device(); }

std::string FlatParamHandle::where(const std::string& op) const {
  return "shardkit FSDP (rank " + std::to_string(rank_) + ", unit '" + options_.label + "') " + op + ": ";
}

std::vector<at::Tensor> FlatParamHandle::shard_views() const {
  std::vector<at::Tensor> views;
  views.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) {
    if (shard_world() == 1) {
      views.push_back(shard_.narrow(0, layout_.offsets()[i], layout_.numels()[i]).view(shapes_[i]));
    } else {
      const core::FlatPiece piece = layout_.piece(i, rank_);
      views.push_back(shard_.narrow(0, piece.shard_begin, piece.numel));
    }
  }
  return views;
}

void FlatParamHandle::set_state(State state) {
  const bool held = holds_full_buffer();
  state_ = state;
  if (options_.gathered_bytes && held != holds_full_buffer()) {
    GatheredBytes& bytes = *options_.gathered_bytes;
    bytes.current += held ? -full_bytes() : full_bytes();
    bytes.peak = std::max(bytes.peak, bytes.current);
  }
}

int64_t FlatParamHandle::full_bytes() const {
  return layout_.padded_numel() * static_cast<int64_t>(c10::elementSize(compute_dtype_));
}

void FlatParamHandle::unshard_start() {
  if (state_ != State::kSharded) return;
  core::IdentityScope identity(identity_);
  core::QuantizationScope quantization(quantization_);
  restore_storage(full_, static_cast<size_t>(full_bytes()));
  const int64_t S = layout_.shard_numel();
  at::Tensor mine = full_.narrow(0, rank_ * S, S);
  if (offload_) {
    // Gathering until unshard_wait even with one rank: the copy-in itself is in flight on a side stream.
    set_state(State::kGathering);
    offload_->copy_in(mine, shard_, [&] {
      if (shard_world() > 1) gather_ = compat::all_gather_single(*shard_group_, full_, mine);
    });
    return;
  }
  {
    at::NoGradGuard no_grad;
    // The copy-in: straight into this rank's slice of the output, cast on the way.
    cast_into(mine, shard_, 1, where("copy-in"));
  }
  if (shard_world() == 1) {
    set_state(State::kUnsharded);
    return;
  }
  gather_ = compat::all_gather_single(*shard_group_, full_, mine);
  set_state(State::kGathering);
}

void FlatParamHandle::unshard_wait() {
  if (state_ == State::kSharded) unshard_start();
  if (state_ == State::kGathering) {
    auto work = std::move(gather_);  // null: an offloaded one-rank copy-in, no collective
    set_state(State::kUnsharded);  // the buffer is ours again whatever the outcome
    if (work) wait_or_explain(work, where("all-gather"));
    if (offload_) offload_->order_after_copy_in();  // this rank's slice (the only one with one rank)
  }
}

void FlatParamHandle::reshard() {
  if (full_is_shard_ || state_ == State::kSharded) return;
  if (state_ == State::kGathering) unshard_wait();  // never free memory a collective still writes
  if (offload_) offload_->settle_copy_in();  // nor while the copy-in may still read the shard or write the buffer
  release_storage(full_);
  set_state(State::kSharded);
}

at::Tensor FlatParamHandle::full_alias() const {
  TORCH_CHECK(state_ == State::kUnsharded, where("views"), "the parameters are not gathered");
  return full_.variable_data();
}

std::vector<at::Tensor> FlatParamHandle::views(const at::Tensor& base) const {
  TORCH_CHECK(base.dim() == 1 && base.numel() == layout_.padded_numel(), where("views"),
              "expected a flat tensor of ", layout_.padded_numel(), " elements, got shape ", base.sizes());
  // One split over parameters, alignment gaps and padding (the chunks that are parameters are viewed in their
  // shapes). Training views are made without autograd (inside FSDP's _FullParameterViews, whose backward packs
  // the gradients with flatten_gradients).
  std::vector<int64_t> sizes;
  std::vector<size_t> chunk_of_param;
  int64_t cursor = 0;
  for (size_t i = 0; i < shapes_.size(); ++i) {
    if (layout_.offsets()[i] > cursor) sizes.push_back(layout_.offsets()[i] - cursor);
    chunk_of_param.push_back(sizes.size());
    sizes.push_back(layout_.numels()[i]);
    cursor = layout_.offsets()[i] + layout_.numels()[i];
  }
  if (layout_.padded_numel() > cursor) sizes.push_back(layout_.padded_numel() - cursor);
  std::vector<at::Tensor> chunks = at::split_with_sizes(base, sizes);
  std::vector<at::Tensor> views;
  views.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) views.push_back(chunks[chunk_of_param[i]].view(shapes_[i]));
  return views;
}

at::Tensor FlatParamHandle::flat_tensor(at::ScalarType dtype, const std::optional<at::Tensor>& memory,
                                        const char* op) const {
  const int64_t numel = layout_.padded_numel();
  if (!memory.has_value() || !full_device().is_cpu()) {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(full_device()));
  }
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(memory->scalar_type() == at::kByte && memory->dim() == 1 && memory->is_contiguous() &&
                  memory->device().is_cpu(),
              where(op), "memory must be a contiguous 1-D uint8 host tensor, got ", memory->scalar_type(), " ",
              memory->sizes(), " on ", memory->device());
  TORCH_CHECK(memory->numel() >= bytes, where(op), "memory of ", memory->numel(), " bytes cannot hold ", numel, " ",
              dtype, " elements (", bytes, " bytes)");
  return memory->narrow(0, 0, bytes).view(dtype);
}

bool FlatParamHandle::flattens_into_memory() const {
  return compute_dtype_ == reduce_dtype_ && full_device().is_cpu();
}

int64_t FlatParamHandle::reduce_input_bytes() const {
  return layout_.padded_numel() * static_cast<int64_t>(c10::elementSize(reduce_dtype_));
}

at::Tensor FlatParamHandle::flatten_gradients(const std::vector<std::optional<at::Tensor>>& grads,
                                              const std::optional<at::Tensor>& memory) const {
  TORCH_CHECK(grads.size() == shapes_.size(), where("flatten gradients"), "expected ", shapes_.size(),
              " gradients, got ", grads.size());
  at::NoGradGuard no_grad;
  at::Tensor flat = flat_tensor(compute_dtype_, flattens_into_memory() ? memory : std::nullopt, "flatten gradients");
  int64_t cursor = 0;  // everything before it is written
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const int64_t offset = layout_.offsets()[i];
    const int64_t numel = layout_.numels()[i];
    if (offset > cursor) flat.narrow(0, cursor, offset - cursor).zero_();
    at::Tensor piece = flat.narrow(0, offset, numel);
    if (grads[i].has_value() && grads[i]->defined()) {
      const at::Tensor& grad = *grads[i];
      TORCH_CHECK(grad.sizes() == at::IntArrayRef(shapes_[i]), where("flatten gradients"), "parameter ", i,
                  " has shape ", at::IntArrayRef(shapes_[i]), " but its gradient has shape ", grad.sizes());
      piece.view(shapes_[i]).copy_(grad);
    } else {
      piece.zero_();
    }
    cursor = offset + numel;
  }
  if (layout_.padded_numel() > cursor) flat.narrow(0, cursor, layout_.padded_numel() - cursor).zero_();
  return flat;
}

void FlatParamHandle::reduce_start(at::Tensor flat_grad, const std::optional<at::Tensor>& memory) {
  TORCH_CHECK(!pending_.has_value(), where("reduce-scatter"), "the previous reduction was not finished");
  core::IdentityScope identity(identity_);
  core::QuantizationScope quantization(quantization_);
  TORCH_CHECK(flat_grad.dim() == 1 && flat_grad.numel() == layout_.padded_numel(), where("reduce-scatter"),
              "expected a flat gradient of ", layout_.padded_numel(), " elements, got shape ", flat_grad.sizes());
  at::NoGradGuard no_grad;
  if (unsynced_grad_.defined()) {
    flat_grad.add_(unsynced_grad_);
    unsynced_grad_ = at::Tensor();
  }
  // The 1/ranks factor. A reduction in half precision divides before the sum (no overflow), fused with
  // the cast into the reduce dtype; one in full precision sums first and divides the result, 1/N of the
  // elements (reduce_finish).
  const int64_t contributors = static_cast<int64_t>(shard_world()) * replicate_world();
  PendingReduce pending;
  at::Tensor input;
  if (flat_grad.scalar_type() != reduce_dtype_) {
    input = flat_tensor(reduce_dtype_, memory, "reduce-scatter");
    cast_into(input, flat_grad, contributors, where("reduce-scatter"));  // the cast and 1/N in one pass
  } else if (c10::elementSize(reduce_dtype_) < 4) {
    input = flat_grad.div_(contributors);
  } else {
    input = flat_grad;
    pending.post_divisor = contributors;
  }
  flat_grad = at::Tensor();
  if (offload_) offload_->gradient_ready();  // the copy-out waits for this much of the compute stream only
  if (shard_world() > 1) {
    pending.output = at::empty({layout_.shard_numel()}, input.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    pending.scatter = compat::reduce_scatter_single(*shard_group_, pending.output, input, opts);
  } else {
    pending.output = input;
  }
  input = at::Tensor();
  if (replicate_group_) {
    // The replica all-reduce needs the scattered shard: issued once the reduce-scatter is done.
    if (pending.scatter) wait_or_explain(std::exchange(pending.scatter, {}), where("reduce-scatter"));
    std::vector<at::Tensor> tensors{pending.output};
    pending.replicate = replicate_group_->allreduce(tensors);
  }
  pending_ = std::move(pending);
}

void FlatParamHandle::reduce_finish(const std::vector<at::Tensor>& params) {
  if (!pending_.has_value()) return;
  PendingReduce pending = std::move(*pending_);
  pending_.reset();
  TORCH_CHECK(params.size() == shapes_.size(), where("reduce"), "expected ", shapes_.size(), " parameters, got ",
              params.size());
  auto wait = [&] {
    if (pending.scatter) wait_or_explain(pending.scatter, where("reduce-scatter"));
    if (pending.replicate) wait_or_explain(pending.replicate, where("replica all-reduce"));
  };
  at::NoGradGuard no_grad;
  // The reduced shard in the parameters' dtype, with the 1/N a full-precision sum still owes: divided in place
  // when no cast is needed (torch's division, bit for bit), else fused with the cast (fsdp/cast.h).
  at::Tensor result;
  if (offload_) {
    // Waited, divided and cast on the copy-out stream, then copied into pinned host memory; returns once the
    // host may read it. `pending.output` (the collectives' output) is held until then.
    result = offload_->copy_out(pending.output, pending.post_divisor, shard_.scalar_type(), wait);
  } else {
    wait();
    result = divide_as(pending.output, pending.post_divisor, shard_.scalar_type(), where("reduce"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor piece;
    if (shard_world() == 1) {
      piece = result.narrow(0, layout_.offsets()[i], layout_.numels()[i]).view(shapes_[i]);
    } else {
      const core::FlatPiece where_piece = layout_.piece(i, rank_);
      piece = result.narrow(0, where_piece.shard_begin, where_piece.numel);
    }
    at::Tensor param = params[i];
    TORCH_CHECK(param.sizes() == piece.sizes(), where("reduce"), "parameter ", i, " has shape ", param.sizes(),
                " but its shard piece has shape ", piece.sizes(),
                " (was the parameter replaced with `p.data = ...` outside summon_full_params?)");
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) {
      grad.add_(piece);
    } else {
      grad = piece;
    }
  }
}

void FlatParamHandle::accumulate_unsynced(const at::Tensor& flat_grad) {
  at::NoGradGuard no_grad;
  if (unsynced_grad_.defined()) {
    unsynced_grad_.add_(flat_grad);
  } else {
    unsynced_grad_ = flat_grad;
  }
}

std::vector<at::Tensor> FlatParamHandle::gather_full_precision() {
  at::NoGradGuard no_grad;
  core::IdentityScope identity(identity_);
  // Offloaded: gathered on the compute device (this rank's slice copied there first, waited for).
  at::Tensor buffer = at::empty({layout_.padded_numel()}, shard_.options().device(full_device()));
  const int64_t S = layout_.shard_numel();
  at::Tensor mine = buffer.narrow(0, rank_ * S, S);
  mine.copy_(shard_);
  // Waited at once, so a backend may run it on this thread: nothing it held (the buffer) outlives the call
  // (a worker thread would drop its reference just after waking us, when a caller gathering unit after unit
  // may already be filling the next buffer: two at once).
  if (shard_world() > 1) {
    wait_or_explain(compat::all_gather_single(*shard_group_, buffer, mine,
                                              compat::waited_at_once(c10d::AllgatherOptions())),
                    where("all-gather"));
  }
  std::vector<at::Tensor> values;
  values.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) {
    values.push_back(buffer.narrow(0, layout_.offsets()[i], layout_.numels()[i]).view(shapes_[i]));
  }
  return values;
}

void FlatParamHandle::write_back(const std::vector<at::Tensor>& full_values) {
  TORCH_CHECK(full_values.size() == shapes_.size(), where("write back"), "expected ", shapes_.size(),
              " values, got ", full_values.size());
  for (size_t i = 0; i < shapes_.size(); ++i) {
    TORCH_CHECK(full_values[i].sizes() == at::IntArrayRef(shapes_[i]), where("write back"), "value ", i,
                " has shape ", full_values[i].sizes(), ", the parameter's is ", at::IntArrayRef(shapes_[i]));
  }
  at::NoGradGuard no_grad;
  if (offload_) offload_->settle_copy_in();  // no copy-in may still be reading the shard we write
  for (const core::FlatPiece& piece : layout_.pieces_of_rank(rank_)) {
    shard_.narrow(0, piece.shard_begin, piece.numel)
        .copy_(full_values[piece.param].detach().reshape(-1).narrow(0, piece.param_begin, piece.numel));
  }
}

}  // namespace shardkit::fsdp

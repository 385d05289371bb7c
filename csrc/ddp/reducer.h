// Reducer: the gradient engine of shardkit.DistributedDataParallel.
//
// Promise: after each synchronised backward, every parameter's .grad holds the average over the process
// group of the ranks' gradients (or what the registered comm hook made of them), exactly as torch's DDP.
//
// How. Parameters are packed into dtype-homogeneous flat buckets, laid out as torch's DDP lays them out
// (so that hooks whose result depends on the layout, like PowerSGD, behave identically): first one bucket
// per dtype in registration order, then, from the second iteration, core::assign_buckets over the order
// the gradients actually arrived in (rank 0's order, so every rank agrees) with a small first bucket and
// `bucket_bytes_cap` after it. With find_unused_parameters the capped layout is used from the start, in
// registration order and launched last-bucket-first, and never rebuilt. A post hook on every parameter's gradient
// accumulator copies the fresh gradient into its bucket slice and, when a bucket is complete and every
// earlier bucket has been launched, launches its reduction — the default allreduce (SUM) or the comm hook —
// so communication overlaps the rest of backward. A final autograd callback waits for the futures in
// bucket order and writes the results back into .grad (the default path divides by the world size in the
// same pass). With `gradient_as_bucket_view`, .grad tensors are views of the buckets and no copy-back
// happens; on a shardkit group (Options::shared_buffer) such CPU buckets live in the group's shared memory, and
// their allreduce reads the peers' buckets in place instead of copying through the group's slots (zero-copy
// buckets). Parameters that got no gradient are either unused-parameter zeros (find_unused_parameters; a
// parameter unused on every rank keeps its .grad untouched) or a clear error naming them.
//
// ZeRO-2 (Options::shard_gradients). The DDP hands over its partition (set_gradient_shards) at
// construction, before any backward. Bucket buffers then exist only while a backward runs: each gradient is
// copied into its bucket and its .grad freed at once; a bucket's members are ordered by flat offset, so
// each rank's share is one contiguous range, and the bucket is reduced with one `reduce` per owner
// instead of an allreduce (a comm hook, if registered, runs as usual and each rank keeps its share of the
// result). finalize() moves each rank's share, averaged, into GradientShards and drops the buffers.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "compat.h"
#include "core/bucket_assignment.h"
#include "core/quantize.h"
#include "ddp/gradient_shards.h"

namespace shardkit::ddp {

class Reducer {
 public:
  struct Options {
    size_t bucket_bytes_cap = 25u << 20;
    size_t first_bucket_bytes = 1u << 20;
    bool find_unused_parameters = false;
    bool gradient_as_bucket_view = false;
    bool shard_gradients = false;  // ZeRO-2: see set_gradient_shards()
    // Zero-copy buckets: where set (the DDP sets it for a shardkit group), CPU buckets with
    // gradient_as_bucket_view live in memory this function returns — a collective every rank calls at the
    // same point, returning a uint8 tensor of the given bytes in which the group's allreduce runs in place
    // (ProcessGroupShardkit::shared_buffer), or an undefined tensor where it cannot (then ordinary buffers).
    std::function<at::Tensor(int64_t bytes)> shared_buffer;
  };

  // `names[i]` names `params[i]` in error messages. Installs the gradient hooks.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Options& options);
  ~Reducer();  // removes the hooks
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called by forward() when a synchronised backward will follow (not under no_sync): arms the hooks and,
  // on the second iteration, rebuilds the buckets in arrival order.
  void prepare_for_backward();
  // Takes ownership of the comm hook; only one may be registered, ever.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);
  // Join (uneven inputs, torch DDP's join(divide_by_initial_world_size=False)): the default averaging of the
  // synchronised backward prepared last divides by `ranks` (those that still had inputs) instead of the world
  // size. Call after prepare_for_backward(); it holds for that backward only.
  void set_divisor_for_this_backward(double ranks);
  // Join: on a rank whose inputs ran out, issues exactly the collectives a synchronised backward issues on
  // the other ranks, in the same order — on the second iteration the bucket rebuild's broadcast, then each
  // bucket's reduction (or comm hook) over zeros, then find_unused_parameters' allreduce — and waits for
  // them. Nothing of this rank's .grad changes; the iteration count advances as a backward's would.
  // Not with shard_gradients (ZeRO-2 ranks must also step their shard: the DDP refuses join() there).
  void shadow_backward();
  // Parameter indices per bucket, in launch order (for tests and introspection).
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Adopts `assignment` (parameter indices per bucket, in launch order, as bucket_indices() returned them in
  // an earlier run) as the final layout; no rebuild follows. A resumed run thus reduces in the buckets its
  // comm-hook state (PowerSGD's error feedback, P and Q are per bucket) was saved with. With zero-copy buckets
  // a collective (the new buckets get a new shared buffer): every rank calls it at the same point.
  void load_bucket_indices(const std::vector<std::vector<size_t>>& assignment);
  // The bucket buffers that exist now (under ZeRO-2 none between backwards), for memory accounting.
  std::vector<at::Tensor> bucket_buffers() const;
  // Whether the buckets live in the group's shared memory (Options::shared_buffer gave it): zero-copy buckets.
  bool zero_copy() const { return zero_copy_; }
  // Whether zero-copy buckets may be averaged by the engine (an AVG allreduce) rather than summed and divided
  // here: on (the default) unless a join divides by the ranks still training (set_divisor_for_this_backward),
  // where the DDP turns it off on every rank, so that all ranks issue the same op. The same bits either way.
  void set_engine_average(bool allowed) { engine_average_ = allowed; }
  // The inter-host wire format of the buckets' own collectives (not a comm hook's): core/quantize.h.
  void set_quantization(core::InterHostQuantization quantization) { quantization_ = quantization; }

  // ZeRO-2 only. Adopts the DDP's partition (see GradientShards for the arguments' meaning); called once,
  // by the DDP right after construction, so gradients land in the shards from the first backward on.
  void set_gradient_shards(std::vector<core::FlatLayout> layouts, std::vector<at::Tensor> shards,
                           std::vector<int64_t> space, std::vector<int64_t> slot);
  // Per parameter: whether its gradient shard holds a gradient (the ZeRO-2 counterpart of `.grad is not None`).
  std::vector<bool> shard_gradient_defined();
  // optimizer.zero_grad() under ZeRO-2.
  void clear_gradient_shards(bool set_to_none);

 private:
  struct Bucket {
    at::Tensor buffer;                 // flat, one dtype
    std::vector<size_t> members;       // parameter indices
    std::vector<size_t> offsets;       // element offset of each member in `buffer`
    std::vector<size_t> lengths;       // elements of each member
    size_t pending = 0;                // members whose gradient has not arrived in this backward
    std::vector<GradientShards::OwnerRange> owners;  // ZeRO-2: each rank's share of the buffer
    bool averaged = false;             // launched as an AVG allreduce: the result is divided already
    uint64_t identity = 0;             // what its collectives carry (core/collective_identity.h)

    size_t numel() const { return offsets.back() + lengths.back(); }
    // The reduction in flight: the allreduce's or the hook's future, or under ZeRO-2 one `reduce` per owner.
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  };
  struct Slot {
    size_t bucket = 0;
    size_t position = 0;  // within the bucket's members
  };

  std::vector<core::BucketParam> param_shapes() const;
  void rebuild_buckets_if_due();  // the second iteration's rebuild (a broadcast); runs under mutex_
  // Waits for every bucket's futures in bucket order; the first failure resets the iteration and is rethrown.
  void wait_for_bucket_futures();
  // find_unused_parameters: the allreduce (MAX) that tells which parameters some rank used.
  std::vector<int32_t> agree_on_used(at::Tensor used);
  // Lays out buckets (parameter indices per bucket, in launch order) and re-points bucket-view grads.
  void build_buckets(const std::vector<std::vector<size_t>>& assignment);
  void mark_ready(size_t index);  // runs under mutex_
  void launch_ready_buckets();
  void launch(size_t bucket_index);
  void finalize();  // the end-of-backward callback
  void reset_iteration();
  at::Tensor allocate_buffer(const Bucket& bucket) const;
  // Zero-copy buckets: every bucket's buffer carved from one shared buffer (a collective); false, nothing
  // changed, where Options::shared_buffer is unset, does not apply, or the group has none.
  bool place_in_shared_buffer(std::vector<Bucket>& buckets);
  at::Tensor bucket_view(size_t index);  // allocates the bucket's buffer if it was dropped (ZeRO-2)
  void finalize_bucket(Bucket& bucket, const at::Tensor& result, bool average,
                       const std::vector<int32_t>& globally_used);
#ifdef SHARDKIT_WITH_CUDA
  // CUDA buckets: every member's .grad = its slice of `result` * factor in one kernel launch (cuda::unpack_);
  // false (nothing done) where a .grad is not a contiguous tensor of the bucket's dtype.
  bool unpack_to_grads(Bucket& bucket, const at::Tensor& result, double factor);
#endif
  std::string where() const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  Options options_;
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;
  std::unique_ptr<GradientShards> shards_;  // ZeRO-2: the DDP's partition, set at construction

  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;  // per parameter
  std::vector<std::pair<compat::GradAccumulatorHandle, uintptr_t>> hooks_;  // accumulator, hook key

  bool zero_copy_ = false;  // the buckets live in a shared buffer (place_in_shared_buffer)
  bool engine_average_ = true;  // see set_engine_average()
  core::InterHostQuantization quantization_;  // see set_quantization()

  std::mutex mutex_;
  bool armed_ = false;            // a synchronised backward is expected
  bool callback_queued_ = false;  // finalize() is queued for the running backward
  size_t next_launch_ = 0;
  std::vector<bool> ready_;       // per parameter, this backward
  int iteration_ = 0;             // synchronised backwards completed
  double divisor_ = 0;            // set_divisor_for_this_backward; 0: the world size
  bool rebuilt_ = false;
  std::vector<size_t> arrival_order_;  // of the first iteration
};

}  // namespace shardkit::ddp

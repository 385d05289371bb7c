// FlatParamHandle: the parameters of one FSDP unit that share a dtype and requires_grad, as one flat,
// sharded parameter (shardkit.FullyShardedDataParallel drives it from module hooks: python/shardkit/fsdp/
// _fsdp1_schedule.py).
//
// Layout: core::FlatLayout over the parameters' numels, the shard group's size and a 16-byte alignment.
// Between steps this rank holds only `shard` (S elements of the parameters' own dtype, the master copy);
// the user's parameters are views of it (shard_views: this rank's piece of each, 1-D, possibly empty; the
// whole parameter in its own shape when the shard group has one rank), so an optimizer steps the shard in
// place and holds state for this rank's elements only.
//
// Unshard (forward, backward): the full buffer holds world · S elements of the compute dtype (param_dtype of
// mixed precision, else the parameters' dtype). This rank's shard is cast-copied straight into its own
// slice of the full buffer, which is then the all-gather's input: no staging buffer, no copy-out, because
// the parameters are used as views of the full buffer (views(), autograd-aware when given the leaf that
// aliases it). Reshard releases the full buffer's storage but keeps the storage object, so tensors autograd
// saved in forward see the data again once the next unshard re-allocates and re-fills it (the backward
// all-gather of FULL_SHARD). The buffer is written only through a tensor with its own version counter, so
// re-filling it never trips autograd's in-place check on the saved views.
//
// Reduce (after a unit's backward): the flat gradient (compute dtype, full size) is reduce-scattered (SUM)
// over the shard group into S elements and, when there is a replicate group (HYBRID_SHARD, NO_SHARD),
// all-reduced over it. The average's 1/ranks factor is applied where it costs least without risking
// overflow: fused with the cast into a different reduce dtype (one pass), before a half-precision sum,
// after a full-precision one (on the S reduced elements only). reduce_finish() waits and hands each parameter its piece
// of the result as .grad: a view of the reduced shard when the parameter had no gradient, added into it
// otherwise (what .grad accumulation across backwards does). No work on gradient elements happens for
// frozen parameters: they live in a handle of their own that never reduces.
//
// Precision casts (fsdp/cast.h, one helper for all three): the copy-in (shard -> full buffer in param_dtype),
// the flat gradient into the reduce dtype fused with 1/N, and the reduced shard back to the parameters' dtype
// fused with the 1/N a full-precision sum still owes. On CUDA tensors they run shardkit's cast_scale kernel,
// which multiplies by 1/N in f32 (f64 for f64) and rounds once; on the CPU, ATen's copy_ / div_out, which
// divide by N. Bitwise: a plain cast (N = 1) is torch's rounding on both; with N not a power of two the CUDA
// multiply can differ from torch's divide in the last bit, and a 16-bit gradient cast up into a wider reduce
// dtype is rounded once on CUDA where torch rounds the quotient to 16 bits first. The in-place divides that
// involve no cast (a half-precision flat gradient before its sum, a full-precision reduced shard of the
// parameters' dtype after it) stay ATen's div_ on every device: bit for bit torch's.
//
// Parameter offload (Options::compute_device set: CPUOffload(offload_params=True)). The shard, and so the
// parameters between steps and the optimizer stepping them, live in PINNED host memory; the full buffer, the
// flat gradient, the collectives and the no_sync accumulation live on `compute_device` (a CUDA device). The
// full buffer is never the shard there, whatever the world size. fsdp/offload.h holds the streams and events:
//   unshard_start   the full buffer is allocated on the caller's (compute) stream; the copy-in stream waits
//                   for it, copies this rank's shard host -> device (cast to param_dtype on the device) into its
//                   slice, and the all-gather is issued while the copy-in stream is current (the backend orders
//                   it after the copy). State: gathering, even with a one-rank shard group (the copy is in flight).
//   unshard_wait    waits for the all-gather, then makes the caller's current stream wait for the copy-in.
//   reshard         the host waits for the copy-in (so the optimizer, a load or a write-back may write the
//                   shard), then the full buffer's memory goes back to the caching allocator.
//   reduce          as above on the device; reduce_start marks on the compute stream where the flat gradient
//                   is final. reduce_finish() makes the copy-out stream wait for that mark, waits for the
//                   collectives with the copy-out stream current, divides / casts the reduced shard to the
//                   parameters' dtype and copies it device -> host into a fresh pinned tensor on that stream; the
//                   host waits for the copy before the pieces become .grad (on the CPU, pinned, in the
//                   parameters' dtype), since the CPU optimizer reads them with no stream in between.
//   full precision  gather_full_precision() copies the shard to the device and gathers there, returning device
//                   tensors (torch FSDP1's summon_full_params and full state dicts give compute-device tensors
//                   unless offload_to_cpu); write_back() copies device values into the pinned shard.
//
// Errors name the unit (`label`), the rank and the offending value. Collectives are issued on the calling
// thread in call order; the caller (the autograd thread, in hook order) keeps that order the same on
// every rank. Each carries the handle's identity (core/collective_identity.h: the unit's label, its parameters'
// count, shapes and dtype), so ranks that pair different units' collectives fail instead of mixing them.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/flat_layout.h"
#include "core/quantize.h"
#include "fsdp/offload.h"

namespace shardkit::fsdp {

// The bytes of full buffers that a set of handles (one FSDP model's) holds apart from their shards: now, and the
// most at once so far. Each handle given it (Options::gathered_bytes) counts its full buffer in as it starts
// holding it (unshard_start) and out as it stops (reshard), so the count is the handles' state, kept nowhere else.
// The handles of one set are called from one thread at a time (the FSDP hooks, in order): plain counters.
struct GatheredBytes {
  int64_t current = 0;
  int64_t peak = 0;
};

class FlatParamHandle {
 public:
  struct Options {
    std::string label;                          // the unit's module path, for messages
    std::optional<at::ScalarType> param_dtype;  // compute dtype of the full buffer (mixed precision)
    std::optional<at::ScalarType> reduce_dtype; // dtype of the gradient reduction
    // Set: parameters offloaded (see the header comment): the shard and the gradients handed out in pinned
    // host memory, the full buffer, flat gradient and collectives on this CUDA device.
    std::optional<at::Device> compute_device;
    int64_t alignment_bytes = 16;
    // Set: where this handle counts its full buffer while holding it (holds_full_buffer(), full_bytes()).
    std::shared_ptr<GatheredBytes> gathered_bytes;
  };

  // `params`: the unit's parameters of one dtype and device, full-shaped (their current values become the
  // shard; when offloaded they may be on the CPU or on the compute device). `shard_group` null: this rank
  // alone holds the whole flat parameter (NO_SHARD); `replicate_group` null: no replication.
  FlatParamHandle(const std::vector<at::Tensor>& params, c10::intrusive_ptr<c10d::ProcessGroup> shard_group,
                  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group, Options options);

  const core::FlatLayout& layout() const { return layout_; }
  // What this handle's collectives carry (core::IdentityScope), the same on every rank that built the same unit.
  uint64_t identity() const { return identity_; }
  // The inter-host wire format (core/quantize.h) of the unit's all-gathers for compute and its gradient
  // reduce-scatter and replica all-reduce; gathers for state dicts (gather_full_precision) stay exact.
  void set_quantization(core::InterHostQuantization quantization) { quantization_ = quantization; }
  const at::Tensor& shard() const { return shard_; }
  // Per parameter: the user-visible sharded value (see the header comment).
  std::vector<at::Tensor> shard_views() const;
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  bool offloaded() const { return offload_ != nullptr; }
  int64_t full_bytes() const;

  // --- unshard / reshard ---
  // Issues the all-gather into the full buffer (nothing when unsharded or in flight already).
  void unshard_start();
  // Waits for an all-gather in flight (starting one first if none is).
  void unshard_wait();
  bool unsharded() const { return state_ == State::kUnsharded; }
  bool in_flight() const { return state_ == State::kGathering; }
  bool allocated() const { return state_ != State::kSharded; }
  // The full buffer is the shard itself (one-rank shard group, no cast): always there, never released.
  bool full_is_shard() const { return full_is_shard_; }
  // The full buffer is held apart from the shard (from unshard_start until reshard; never when it is the shard
  // itself): what reshard() frees, and what counts in Options::gathered_bytes.
  bool holds_full_buffer() const { return state_ != State::kSharded && !full_is_shard_; }
  void reshard();
  // The full buffer as a tensor of its own version counter (an autograd leaf is made from it).
  at::Tensor full_alias() const;
  // Per parameter: `base` (the full buffer or a tensor aliasing it) split into the parameters' shapes.
  std::vector<at::Tensor> views(const at::Tensor& base) const;

  // --- gradients ---
  // The gradient of the full buffer (compute dtype, padded size) from the parameters' gradients (handle order,
  // each full-shaped or undefined: none, zeros), with zeros in the alignment gaps and the padding. `memory`
  // (optional): host bytes to make it in — a shared buffer of the shard group, so that the reduce-scatter reads
  // the peers' gradients where they lie (zero-copy) — used when the reduction takes the gradient as it is
  // (reduce dtype == compute dtype, full buffer on the host); otherwise the gradient is a new tensor.
  at::Tensor flatten_gradients(const std::vector<std::optional<at::Tensor>>& grads,
                               const std::optional<at::Tensor>& memory) const;
  // Bytes the reduce-scatter's input takes (padded size in the reduce dtype): what `memory` above and
  // reduce_start's `memory` must hold.
  int64_t reduce_input_bytes() const;
  // Whether flatten_gradients makes the gradient in its `memory` (else reduce_start makes the cast there, if any).
  bool flattens_into_memory() const;
  // `flat_grad`: the gradient of the full buffer (compute dtype, padded size; consumed). The gradient
  // accumulated under no_sync is added first. `memory` (optional host bytes, as above): where the reduce dtype's
  // copy is made when the gradient needs a cast, on the host; else a new tensor.
  void reduce_start(at::Tensor flat_grad, const std::optional<at::Tensor>& memory = std::nullopt);
  // Waits for the reduction and writes each parameter's piece into its .grad (params: the user's
  // parameters, in handle order). Nothing when no reduction is pending.
  void reduce_finish(const std::vector<at::Tensor>& params);
  bool reduce_pending() const { return pending_.has_value(); }
  // no_sync(): accumulates a backward's flat gradient locally (full size), reduced with the next synced one.
  void accumulate_unsynced(const at::Tensor& flat_grad);

  // --- full precision gather (summon_full_params, state dicts) ---
  // A blocking all-gather of the shard in its own dtype; returns per parameter a full-shaped tensor (on the
  // compute device when offloaded).
  std::vector<at::Tensor> gather_full_precision();
  // Copies this rank's piece of each given full-shaped value into the shard (summon writeback, loading).
  void write_back(const std::vector<at::Tensor>& full_values);

 private:
  enum class State { kSharded, kGathering, kUnsharded };
  // The reduce-scatter's input is not held here: the backend keeps it alive until the collective has run
  // (c10d's contract for asynchronous ops), so on the shardkit backend its memory goes back as soon as
  // the worker is done with it, while backward computes the next unit, not when reduce_finish() is called.
  struct PendingReduce {
    at::Tensor output;  // reduce dtype, S elements (the input itself when the shard group has one rank)
    c10::intrusive_ptr<c10d::Work> scatter;     // null when the shard group has one rank
    c10::intrusive_ptr<c10d::Work> replicate;   // null without a replicate group (issued after `scatter`)
    int64_t post_divisor = 1;                   // the sum still to be divided by this (full-precision sums)
  };

  std::string where(const std::string& op) const;
  // Every change of state_ after construction goes through here: it keeps Options::gathered_bytes in step.
  void set_state(State state);
  // A flat tensor of `dtype` (padded size) over host bytes `memory` when given and the full buffer is on the
  // host, else a new one on the full buffer's device.
  at::Tensor flat_tensor(at::ScalarType dtype, const std::optional<at::Tensor>& memory, const char* op) const;
  at::Device full_device() const;  // where the full buffer lives: the compute device when offloaded
  int shard_world() const { return shard_group_ ? shard_group_->getSize() : 1; }
  int replicate_world() const { return replicate_group_ ? replicate_group_->getSize() : 1; }

  std::vector<std::vector<int64_t>> shapes_;
  core::FlatLayout layout_;
  uint64_t identity_ = 0;
  core::InterHostQuantization quantization_;  // see set_quantization()
  c10::intrusive_ptr<c10d::ProcessGroup> shard_group_;
  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group_;
  Options options_;
  int rank_ = 0;
  at::ScalarType compute_dtype_;
  at::ScalarType reduce_dtype_;
  at::Tensor shard_;
  // The full buffer; when it is the shard itself (one-rank shard group, no cast) it is never released.
  at::Tensor full_;
  bool full_is_shard_ = false;
  State state_ = State::kSharded;
  c10::intrusive_ptr<c10d::Work> gather_;
  std::optional<PendingReduce> pending_;
  at::Tensor unsynced_grad_;
  // Offloaded only. Declared after the tensors it copies: destroyed first, it settles a copy-in in flight
  // before the full buffer's memory goes back to the allocator.
  std::unique_ptr<HostOffload> offload_;
};

}  // namespace shardkit::fsdp

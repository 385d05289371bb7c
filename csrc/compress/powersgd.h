// PowerSGD gradient compression (Vogels et al., 2019) as C++ DDP comm hooks, bucket for bucket the
// algorithm of torch's ddp_comm_hooks/powerSGD_hook.py, so that the same seed gives the same gradients.
//
// powerSGD_hook, per bucket (after `start_iter` plain averaging allreduces):
//   1. error feedback: M += e (e from the previous step, zeros at first); keep a copy of M;
//   2. each gradient viewed as an n x m matrix (dim 0 by the rest), r = min(n, m, rank); compressed only
//      when (n + m)·r·min_compression_rate < n·m; the others are concatenated and allreduced as they are;
//   3. P = M·Q for each compressed matrix (Q: the previous step's with warm start, re-orthogonalised; else
//      randn from torch.manual_seed(rng.randint(1e9)), rng = numpy's RandomState(random_seed),
//      drawn in order of shape groups, then orthogonalised); allreduce all P in one flat buffer;
//   4. orthogonalise P (Gram–Schmidt for r <= 2 or half precision, else QR); Q = Mᵀ·P; allreduce Q; Q /= N;
//      (Mᵀ·P is computed as (Pᵀ·M)ᵀ, which streams M by rows: equal to torch's up to rounding);
//   5. M ≈ P·Qᵀ written over the gradients in the bucket; e = copy − M.
// With batch_tensors_with_same_shape, matrices of one shape are stacked and multiplied as one batch.
//
// batched_powerSGD_hook: the whole bucket as one square matrix (side ⌈√numel⌉, zero padded), one P and
// one Q per bucket; otherwise the same steps. (Unlike torch's 2.13 hook, whose orthogonalisation asserts
// on its 2-D P and Q, the matrices are orthogonalised as a batch of one; epsilon 0 as torch's.)
//
// Where torch spends its time on memory, this does not: error feedback happens in place in the error buffer
// (no per-step clone of the bucket, no fresh error tensor), and the batched hook writes P·Qᵀ straight into
// the bucket.
// Every collective is chained through futures (csrc/compress/futures.h): a hook returns at once. The state
// is shared by all buckets and by Python (checkpoints), so its maps are guarded by a mutex; one bucket's
// steps run one after another, and different buckets touch different entries.
//
// Collective order: bucket i's P and Q go out from future callbacks while the autograd thread is already
// launching bucket i+1, so each state owns a CollectiveSequencer (csrc/core/collective_sequencer.h). A hook
// reserves one ticket per collective it will issue (averaging: 1; powersgd: uncompressed, P, Q; batched:
// P, Q) when it runs — bucket order, the same on every rank — and each collective goes out in its turn:
// every rank issues U0 P0 Q0 U1 P1 Q1 ... whatever the timing. gloo and NCCL need that, as they match
// collectives by issue order. The price: bucket i+1's first allreduce waits (without blocking anyone)
// until bucket i's Q is out. After a failed collective the state refuses further work (the error says so).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "compress/futures.h"
#include "core/collective_sequencer.h"
#include "core/mt19937.h"

namespace shardkit::compress {

struct PowerSGDOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;
  uint32_t random_seed = 0;
  bool batch_tensors_with_same_shape = false;
};

// Held by std::shared_ptr (the hooks' continuations keep it alive while a bucket is in flight).
class PowerSGDState : public std::enable_shared_from_this<PowerSGDState> {
 public:
  // Validates as torch does (error feedback or warm start need start_powerSGD_iter > 1).
  PowerSGDState(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const PowerSGDOptions& options);

  FuturePtr powersgd_hook(c10d::GradBucket& bucket);
  FuturePtr batched_powersgd_hook(c10d::GradBucket& bucket);

  const PowerSGDOptions& options() const { return options_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }
  void set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group);

  // Checkpoint state. The maps are keyed by bucket index; P and Q as the hooks keep them (flat for
  // powersgd_hook, side x rank for the batched one).
  struct Snapshot {
    int64_t iter = 0;
    int64_t numel_before = 0;  // total_numel_before_compression
    int64_t numel_after = 0;   // total_numel_after_compression
    std::map<int64_t, at::Tensor> error, p, q;
    std::vector<int64_t> rng_key;  // numpy RandomState's MT19937 key (624 words) and position
    int64_t rng_pos = 0;
  };
  Snapshot snapshot();  // deep copies
  // The counters alone (iteration, total_numel_before/after_compression), without copying any tensor.
  std::tuple<int64_t, int64_t, int64_t> counters();
  void restore(const Snapshot& snapshot);

 private:
  // Before start_powerSGD_iter: torch's averaging allreduce of the bucket (in its turn); afterwards null
  // (compress it).
  FuturePtr allreduce_before_start(c10d::GradBucket& bucket);
  // Counts the bucket's iteration once the last bucket has been reduced (torch's maybe_increase_iter).
  void finish_bucket(bool last_bucket);
  // The error buffer of bucket `index` (`numel` zeros at first) with `values` added to its first elements:
  // it becomes M, in place. Returns it.
  at::Tensor error_plus(int64_t index, const at::Tensor& values, int64_t numel);
  // Seeds a generator as torch.manual_seed(rng.randint(1_000_000_000)) does.
  at::Generator next_generator();

  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  PowerSGDOptions options_;
  std::mutex mutex_;
  int64_t iter_ = 0;
  int64_t numel_before_ = 0;
  int64_t numel_after_ = 0;
  std::map<int64_t, at::Tensor> error_, p_, q_;
  std::map<int64_t, at::Tensor> padded_;  // batched hook without error feedback: each bucket's padded M
  core::Mt19937 rng_;
  // Issues every collective of the hooks in the order the hooks reserved them (see the top of this file).
  std::shared_ptr<core::CollectiveSequencer> sequencer_ = std::make_shared<core::CollectiveSequencer>();
};

// Orthogonalises the columns of each matrix of a batch (b x n x r, r <= n) in place, as torch's
// _orthogonalize: Gram–Schmidt for r <= 2 or half precision (epsilon added to each norm), QR otherwise.
void orthogonalize(at::Tensor matrices, double epsilon);

}  // namespace shardkit::compress

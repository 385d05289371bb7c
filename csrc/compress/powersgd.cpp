#include "compress/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include "profile_span.h"
#ifdef SHARDKIT_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace shardkit::compress {

namespace {

constexpr const char* kOwner = "PowerSGDState";

std::string where(const c10d::ProcessGroup& group) {
  return "shardkit PowerSGD (rank " + std::to_string(group.getRank()) + "): ";
}

// How an error names one of a bucket's collectives: "shardkit PowerSGD (rank 0): bucket 4's P allreduce".
std::string collective_name(const c10d::ProcessGroup& group, int64_t bucket, const char* collective) {
  return where(group) + "bucket " + std::to_string(bucket) + "'s " + collective;
}

// One bucket's compression in flight: what every continuation of powersgd_hook needs.
struct PowerSGDJob {
  at::Tensor input;   // the bucket buffer; the result is written into it
  at::Tensor error;   // error feedback: holds M = gradient + previous error, then M - result (in place)
  std::vector<at::Tensor> uncompressed_in, uncompressed_out;  // gradients allreduced as they are: from M, to input
  at::Tensor uncompressed_memory;                             // ... concatenated
  at::Tensor p_memory, q_memory;                              // all P, all Q of the bucket, flat
  std::vector<at::Tensor> batches, ps, qs;  // b x n x m matrices (of M) and their b x n x r, b x m x r factors
  std::vector<at::Tensor> outputs;          // per batch: where P·Qᵀ goes (input views, or the stacked copy)
  std::vector<std::vector<at::Tensor>> unstack_to;  // per stacked batch: the input views to copy it back into
  int64_t index = 0;
  bool last = false;
};

// Q = Mᵀ·P for a batch, computed as (Pᵀ·M)ᵀ: a row-major M is then streamed row by row instead of read
// with a column stride (for a 4096 x 1024 matrix at rank 2: ~5 ms instead of ~23 ms on one core). Same
// product; the summation order inside the GEMM differs from torch's bmm(Mᵀ, P) in the last bits.
void transposed_product(at::Tensor& q, const at::Tensor& m, const at::Tensor& p) {
  q.copy_(at::bmm(p.transpose(1, 2), m).transpose(1, 2));
}

}  // namespace

void orthogonalize(at::Tensor matrices, double epsilon) {
  TORCH_INTERNAL_ASSERT(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1), "orthogonalize: sizes ",
                        matrices.sizes());
  const int64_t rank = matrices.size(2);
  const auto dtype = matrices.scalar_type();
  if (rank <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
#ifdef SHARDKIT_WITH_CUDA
    if (matrices.is_cuda() && matrices.is_contiguous()) {  // the same steps, every matrix in one launch
      cuda::orthogonalize_(matrices, epsilon);
      return;
    }
#endif
    // Gram–Schmidt: normalise column i, then remove its projection from the columns after it.
    for (int64_t i = 0; i < rank; ++i) {
      at::Tensor column = matrices.narrow(2, i, 1);
      at::Tensor norm = at::linalg_vector_norm(column, 2, at::IntArrayRef{1}, /*keepdim=*/true);
      if (epsilon == 0) {
        column.div_(norm);
      } else {
        column.div_(norm + epsilon);
      }
      if (i + 1 < rank) {
        at::Tensor rest = matrices.narrow(2, i + 1, rank - i - 1);
        rest.sub_(at::sum(column * rest, at::IntArrayRef{1}, /*keepdim=*/true) * column);
      }
    }
  } else {
    at::Tensor r = at::empty({matrices.size(0), rank, rank}, matrices.options());
    at::linalg_qr_out(matrices, r, matrices);
  }
}

PowerSGDState::PowerSGDState(c10::intrusive_ptr<c10d::ProcessGroup> process_group, const PowerSGDOptions& options)
    : process_group_(std::move(process_group)), options_(options), rng_(options.random_seed) {
  TORCH_CHECK(process_group_, "shardkit PowerSGD: no process group");
  TORCH_CHECK(!((options_.use_error_feedback || options_.warm_start) && options_.start_powerSGD_iter <= 1),
              where(*process_group_), "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
              "enabled, because PowerSGD can only be applied after the first two iterations in DDP (got ",
              options_.start_powerSGD_iter, ").");
  TORCH_CHECK(options_.matrix_approximation_rank >= 1, where(*process_group_),
              "matrix_approximation_rank must be at least 1, got ", options_.matrix_approximation_rank);
}

void PowerSGDState::set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TORCH_CHECK(group, "shardkit PowerSGD: no process group");
  std::lock_guard<std::mutex> lock(mutex_);
  process_group_ = std::move(group);
}

void PowerSGDState::finish_bucket(bool last_bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (last_bucket) ++iter_;
}

at::Generator PowerSGDState::next_generator() {
  std::lock_guard<std::mutex> lock(mutex_);
  return at::detail::createCPUGenerator(rng_.randint(1000000000));
}

FuturePtr PowerSGDState::allreduce_before_start(c10d::GradBucket& bucket) {
  const at::Tensor& input = bucket.getBuffer();
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), where(*process_group_), "PowerSGD compresses floating-point "
              "gradients; bucket ", bucket.getIndex(), " holds ", input.scalar_type());
  bool warming_up;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    warming_up = iter_ < options_.start_powerSGD_iter;
  }
  if (!warming_up) return {};
  finish_bucket(bucket.isLast());  // counted now, as torch's hook does on this path
  // torch's default averaging allreduce (default_hooks.allreduce_hook): divide, sum, hand the bucket back.
  const auto group = process_group_;
  input.div_(group->getSize());
  FuturePtr result = tensor_future(input);
  std::string name = collective_name(*group, bucket.getIndex(), "averaging allreduce");
  const uint64_t ticket = sequencer_->reserve(1);  // nothing may throw between reserving and submitting
  then_run_in_turn(
      sequencer_, ticket, result, std::move(name), kOwner, [group, input] { return allreduce_sum(group, input); },
      [result, input] { result->markCompleted(c10::IValue(input)); });
  return result;
}

// Error feedback in place. torch's hook adds the error into the bucket, clones the bucket and allocates
// the new error each step: two fresh bucket-sized allocations whose page faults cost more than the
// arithmetic. Here the error buffer itself becomes M (error += gradient, the same sum), the matrices are
// read from it, and after decompression error -= result leaves M - result, the next error.
at::Tensor PowerSGDState::error_plus(int64_t index, const at::Tensor& values, int64_t numel) {
  at::Tensor error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor& kept = error_[index];
    if (!kept.defined()) kept = at::zeros({numel}, values.options());
    error = kept;
  }
  error.narrow(0, 0, values.numel()).add_(values);
  return error;
}

FuturePtr PowerSGDState::powersgd_hook(c10d::GradBucket& bucket) {
  SHARDKIT_PROFILE_SPAN("shardkit::powersgd[" + std::to_string(bucket.getIndex()) + "]");
  if (FuturePtr plain = allreduce_before_start(bucket)) return plain;
  const auto group = process_group_;
  at::Tensor input = bucket.getBuffer();
  auto job = std::make_shared<PowerSGDJob>();
  job->input = input;
  job->index = static_cast<int64_t>(bucket.getIndex());
  job->last = bucket.isLast();
  const int64_t rank_cap = options_.matrix_approximation_rank;
  const double epsilon = options_.orthogonalization_epsilon;

  // 1. Error feedback: M is read from the error buffer (see error_plus), the result goes to the bucket.
  at::Tensor source = input;
  if (options_.use_error_feedback) source = job->error = error_plus(job->index, input, input.numel());
  const auto source_of = [&](const at::Tensor& gradient) {
    return source.narrow(0, gradient.storage_offset() - input.storage_offset(), gradient.numel())
        .view(gradient.sizes());
  };

  // 2. Which gradients are worth compressing.
  std::vector<std::pair<at::Tensor, at::Tensor>> to_compress;  // (M view, output view), n x m
  int64_t total_p = 0, total_q = 0, before = 0, after = 0;
  for (const at::Tensor& gradient : bucket.getGradients()) {
    const int64_t n = gradient.dim() == 0 ? 1 : gradient.size(0);
    const int64_t m = n == 0 ? 0 : gradient.numel() / n;
    const int64_t r = std::min({n, m, rank_cap});
    before += n * m;
    if (static_cast<double>((n + m) * r) * options_.min_compression_rate < static_cast<double>(n * m)) {
      to_compress.emplace_back(source_of(gradient).view({n, m}), gradient.view({n, m}));
      total_p += n * r;
      total_q += m * r;
      after += (n + m) * r;
    } else {
      job->uncompressed_in.push_back(source_of(gradient).reshape({-1}));
      job->uncompressed_out.push_back(gradient);
      after += n * m;
    }
  }
  job->uncompressed_memory =
      job->uncompressed_in.empty() ? at::empty({0}, input.options()) : at::cat(job->uncompressed_in);

  // 3. P and Q memory (kept across steps with warm start), matrices grouped by shape in order of appearance.
  bool randomize = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    numel_before_ += before;
    numel_after_ += after;
    if (!options_.warm_start || p_.find(job->index) == p_.end()) {
      randomize = true;
      p_[job->index] = at::empty({total_p}, input.options());
      q_[job->index] = at::empty({total_q}, input.options());
    }
    job->p_memory = p_[job->index];
    job->q_memory = q_[job->index];
  }
  std::vector<std::pair<at::IntArrayRef, std::vector<size_t>>> by_shape;
  for (size_t i = 0; i < to_compress.size(); ++i) {
    const auto sizes = to_compress[i].first.sizes();
    auto same = std::find_if(by_shape.begin(), by_shape.end(), [&](const auto& entry) { return entry.first == sizes; });
    if (same == by_shape.end()) {
      by_shape.emplace_back(sizes, std::vector<size_t>{i});
    } else {
      same->second.push_back(i);
    }
  }
  for (const auto& [shape, members] : by_shape) {
    if (options_.batch_tensors_with_same_shape && members.size() > 1) {
      std::vector<at::Tensor> sources, outputs;
      for (size_t i : members) {
        sources.push_back(to_compress[i].first);
        outputs.push_back(to_compress[i].second);
      }
      job->batches.push_back(at::stack(sources));
      job->outputs.push_back(job->batches.back());  // P·Qᵀ overwrites the stacked copy, then is unstacked
      job->unstack_to.push_back(std::move(outputs));
    } else {
      for (size_t i : members) {  // one by one (with batching on, this shape has one matrix)
        job->batches.push_back(to_compress[i].first.unsqueeze(0));
        job->outputs.push_back(to_compress[i].second.unsqueeze(0));
        job->unstack_to.emplace_back();
      }
    }
  }
  int64_t p_offset = 0, q_offset = 0;
  for (const auto& batch : job->batches) {
    const int64_t b = batch.size(0), n = batch.size(1), m = batch.size(2), r = std::min({n, m, rank_cap});
    job->ps.push_back(job->p_memory.narrow(0, p_offset, b * n * r).view({b, n, r}));
    job->qs.push_back(job->q_memory.narrow(0, q_offset, b * m * r).view({b, m, r}));
    p_offset += b * n * r;
    q_offset += b * m * r;
  }
  if (!randomize) {
    for (auto& q : job->qs) orthogonalize(q, epsilon);
  } else {
    at::Generator generator = next_generator();
    for (auto& q : job->qs) {
      q.copy_(at::randn(q.sizes(), generator, at::TensorOptions().dtype(q.scalar_type())));
      orthogonalize(q, epsilon);
    }
  }
  for (size_t i = 0; i < job->batches.size(); ++i) at::bmm_out(job->ps[i], job->batches[i], job->qs[i]);

  // 4-5. Allreduce the uncompressed gradients, then P, then Q; decompress. Each step in a continuation,
  // each collective in its turn: three consecutive tickets, reserved now (bucket order).
  const auto self = shared_from_this();
  const int64_t world = group->getSize();
  FuturePtr result = tensor_future(input);
  const auto name = [group, job](const char* collective) { return collective_name(*group, job->index, collective); };
  std::string u_name = name("uncompressed allreduce");
  const uint64_t ticket = sequencer_->reserve(3);  // nothing may throw between reserving and submitting
  then_run_in_turn(
      sequencer_, ticket, result, std::move(u_name), kOwner,
      [group, job] { return allreduce_sum(group, job->uncompressed_memory); },
      [self, job, group, result, world, epsilon, ticket, name] {
    job->uncompressed_memory.div_(world);
    int64_t offset = 0;
    for (auto& gradient : job->uncompressed_out) {
      gradient.copy_(job->uncompressed_memory.narrow(0, offset, gradient.numel()).view_as(gradient));
      offset += gradient.numel();
    }
    // P is not divided by the world size: it is orthogonalised next.
    then_run_in_turn(
        self->sequencer_, ticket + 1, result, name("P allreduce"), kOwner,
        [group, job] { return allreduce_sum(group, job->p_memory); },
        [self, job, group, result, world, epsilon, ticket, name] {
      for (auto& p : job->ps) orthogonalize(p, epsilon);
      for (size_t i = 0; i < job->batches.size(); ++i) transposed_product(job->qs[i], job->batches[i], job->ps[i]);
      then_run_in_turn(
          self->sequencer_, ticket + 2, result, name("Q allreduce"), kOwner,
          [group, job] { return allreduce_sum(group, job->q_memory); }, [self, job, result, world] {
        job->q_memory.div_(world);
        for (size_t i = 0; i < job->batches.size(); ++i) {
          at::bmm_out(job->outputs[i], job->ps[i], job->qs[i].transpose(1, 2));
          for (size_t k = 0; k < job->unstack_to[i].size(); ++k) job->unstack_to[i][k].copy_(job->outputs[i][k]);
        }
        if (job->error.defined()) job->error.sub_(job->input);  // M - result: the next step's error
        if (!self->options_.warm_start) {
          std::lock_guard<std::mutex> lock(self->mutex_);
          self->p_.clear();
          self->q_.clear();
        }
        self->finish_bucket(job->last);
        result->markCompleted(c10::IValue(job->input));
      });
    });
  });
  return result;
}

FuturePtr PowerSGDState::batched_powersgd_hook(c10d::GradBucket& bucket) {
  SHARDKIT_PROFILE_SPAN("shardkit::batched_powersgd[" + std::to_string(bucket.getIndex()) + "]");
  if (FuturePtr plain = allreduce_before_start(bucket)) return plain;
  const auto group = process_group_;
  at::Tensor input = bucket.getBuffer();
  const int64_t index = static_cast<int64_t>(bucket.getIndex());
  const bool last = bucket.isLast();
  const int64_t total = input.numel();
  const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  const int64_t rank = options_.matrix_approximation_rank;
  TORCH_CHECK(rank <= side, where(*group), "batched PowerSGD: matrix_approximation_rank ", rank, " exceeds the side ",
              side, " of bucket ", index, "'s square matrix");
  // M, the bucket as a zero-padded side x side matrix (the bucket buffer itself is never resized, as torch's
  // hook does): with error feedback the error buffer plus the bucket (error_plus; the padding adds
  // nothing), else the bucket copied into a per-bucket padded buffer kept across steps.
  bool randomize = false;
  at::Tensor error, matrix;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    numel_before_ += total;
    numel_after_ += side * rank * 2;
    randomize = !options_.warm_start || p_.find(index) == p_.end();
    if (randomize) p_[index] = at::empty({side, rank}, input.options());
    if (!options_.use_error_feedback) {
      at::Tensor& kept = padded_[index];
      if (!kept.defined() || kept.numel() != side * side) kept = at::zeros({side * side}, input.options());
      matrix = kept.view({side, side});  // its padding stays zero: only the bucket's part is ever written
    }
  }
  if (options_.use_error_feedback) {
    error = error_plus(index, input, side * side);
    matrix = error.view({side, side});
  } else {
    matrix.view(-1).narrow(0, 0, total).copy_(input);
  }
  if (randomize) {
    at::Generator generator = next_generator();
    at::Tensor fresh = at::randn({side, rank}, generator, at::TensorOptions().dtype(input.scalar_type()));
    std::lock_guard<std::mutex> lock(mutex_);
    q_[index] = fresh.to(input.device());
  }
  at::Tensor p, q;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p = p_[index];
    q = q_[index];
  }
  orthogonalize(q.unsqueeze(0), 0);
  at::mm_out(p, matrix, q);
  const auto self = shared_from_this();
  const int64_t world = group->getSize();
  FuturePtr result = tensor_future(input);
  std::string p_name = collective_name(*group, index, "P allreduce");
  const uint64_t ticket = sequencer_->reserve(2);  // P, Q: consecutive, reserved in bucket order
  then_run_in_turn(
      sequencer_, ticket, result, std::move(p_name), kOwner, [group, p] { return allreduce_sum(group, p); }, [=] {
    orthogonalize(p.unsqueeze(0), 0);
    at::Tensor q_out = q.unsqueeze(0);
    transposed_product(q_out, matrix.unsqueeze(0), p.unsqueeze(0));
    then_run_in_turn(self->sequencer_, ticket + 1, result, collective_name(*group, index, "Q allreduce"), kOwner,
                     [group, q] { return allreduce_sum(group, q); }, [=] {
      q.div_(world);
      // P·Qᵀ: the rows wholly inside the bucket straight into it, the rest (the last partial row and the
      // padding rows) into a small tail.
      const int64_t full_rows = total / side, rest = total - full_rows * side;
      at::Tensor head = input.narrow(0, 0, full_rows * side).view({full_rows, side});
      at::mm_out(head, p.narrow(0, 0, full_rows), q.t());
      at::Tensor tail = at::mm(p.narrow(0, full_rows, side - full_rows), q.t()).view(-1);
      input.narrow(0, full_rows * side, rest).copy_(tail.narrow(0, 0, rest));
      if (error.defined()) {  // M - result: the next step's error
        error.narrow(0, 0, total).sub_(input);
        error.narrow(0, total, side * side - total).sub_(tail.narrow(0, rest, tail.numel() - rest));
      }
      if (!self->options_.warm_start) {
        std::lock_guard<std::mutex> lock(self->mutex_);
        self->p_.clear();
        self->q_.clear();
      }
      self->finish_bucket(last);
      result->markCompleted(c10::IValue(input));
    });
  });
  return result;
}

std::tuple<int64_t, int64_t, int64_t> PowerSGDState::counters() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {iter_, numel_before_, numel_after_};
}

PowerSGDState::Snapshot PowerSGDState::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  Snapshot out;
  out.iter = iter_;
  out.numel_before = numel_before_;
  out.numel_after = numel_after_;
  for (const auto& [index, tensor] : error_) out.error[index] = tensor.clone();
  for (const auto& [index, tensor] : p_) out.p[index] = tensor.clone();
  for (const auto& [index, tensor] : q_) out.q[index] = tensor.clone();
  out.rng_key.assign(rng_.key.begin(), rng_.key.end());
  out.rng_pos = rng_.pos;
  return out;
}

void PowerSGDState::restore(const Snapshot& snapshot) {
  TORCH_CHECK(snapshot.rng_key.size() == core::Mt19937::kWords && snapshot.rng_pos >= 0 &&
                  snapshot.rng_pos <= core::Mt19937::kWords,
              where(*process_group_), "load_state_dict: the rng state must be ", core::Mt19937::kWords,
              " key words and a position in [0, ", core::Mt19937::kWords, "], got ", snapshot.rng_key.size(),
              " words and position ", snapshot.rng_pos);
  std::lock_guard<std::mutex> lock(mutex_);
  iter_ = snapshot.iter;
  numel_before_ = snapshot.numel_before;
  numel_after_ = snapshot.numel_after;
  error_.clear();
  p_.clear();
  q_.clear();
  for (const auto& [index, tensor] : snapshot.error) error_[index] = tensor.clone();
  for (const auto& [index, tensor] : snapshot.p) p_[index] = tensor.clone();
  for (const auto& [index, tensor] : snapshot.q) q_[index] = tensor.clone();
  for (int i = 0; i < core::Mt19937::kWords; ++i) rng_.key[i] = static_cast<uint32_t>(snapshot.rng_key[i]);
  rng_.pos = static_cast<int>(snapshot.rng_pos);
}

}  // namespace shardkit::compress

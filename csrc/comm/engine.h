// Engine: the one small interface behind which the shardkit backend runs every collective.
//
// ProcessGroupShardkit (backend.h) validates a collective once, turns its list/coalesced/non-contiguous form
// into calls on contiguous tensors, and hands them to the engine its routing point picks:
//   - ShmEngine (shm_engine.h): every rank on one host, through the shared-memory segment;
//   - HierarchicalEngine (hierarchical_engine.h): ranks on several hosts: shared memory inside each host,
//     gloo among the hosts' leaders, gloo over all ranks only where no hierarchy applies;
//   - NcclEngine (nccl/nccl_engine.h) for CUDA tensors, or HostStagedEngine (nccl/host_staged_engine.h) where
//     NCCL cannot serve; CudaRoute (nccl/cuda_route.h) chooses and sets their streams up.
// No op decides topology by itself. What an engine promises:
//   - tensors are contiguous, of one dtype and on one device (the CPU; CUDA for the CUDA engines), already
//     checked against the op's shape rules;
//     counts are in elements;
//   - everything a single op needs (its deadline, its name and number for messages) travels in OpContext; the
//     timeout bounds the whole op, however many steps it takes (OpContext::left());
//   - any failure (peer died, disagreement, timeout, an inner backend's error) aborts the engine for good,
//     on this rank and, as fast as the engine can tell them, on every other rank; later ops fail at once
//     with the first reason; errors name the user's op, its number and global ranks.
// Reductions arrive as core::ReduceOp: AVG and PREMUL_SUM are applied around the engine by the backend.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/quantize.h"
#include "core/shm_group.h"
#include "core/types.h"

namespace shardkit::comm {

// One collective as the user issued it.
struct OpContext {
  const char* op = "";  // the user's collective ("allreduce", "all_gather_into_tensor", ...)
  uint64_t seq = 0;     // its number in the group (1, 2, ...), in the order collectives run (the same on every rank)
  std::chrono::milliseconds timeout{0};
  int rank = 0;         // this rank in the group (roots are group ranks too)
  int global_rank = 0;  // this rank in the job: how messages name it
  uint64_t identity = 0;  // the part of a model the op moves, as its issuer named it (core/collective_identity.h)
  // The group compares every op's identity across hosts (ProcessGroupShardkit::compare_identities_across_hosts):
  // the same on every rank for a given op, unlike `identity`, so it decides what the host leaders exchange.
  bool compare_across_hosts = false;
  // How its bytes cross between hosts, as its issuer asked (core::QuantizationScope): the hierarchical engine
  // quantizes an all-gather's floating data with `gather` and a floating sum's (reduce-scatter, allreduce) with
  // `reduce`; everything else, and every byte inside a host, moves exact.
  core::InterHostQuantization quantization{};
  // When the op began to run: `timeout` bounds the whole op from here, however many steps it takes (a wait for
  // one of its steps gets what is left, left()). Unset: each wait gets the whole timeout.
  std::chrono::steady_clock::time_point started{};

  // The op's deadline; what is left of its timeout (at least 1 ms, so that a wait still looks once).
  std::chrono::steady_clock::time_point deadline() const {
    return (started == std::chrono::steady_clock::time_point{} ? std::chrono::steady_clock::now() : started) + timeout;
  }
  std::chrono::milliseconds left() const {
    const auto rest = std::chrono::duration_cast<std::chrono::milliseconds>(deadline() - std::chrono::steady_clock::now());
    return std::max(rest, std::chrono::milliseconds(1));
  }

  // The same op, as told to a shared-memory group that runs all of it or one step of it.
  core::CallInfo call(bool step = false) const { return {timeout, op, seq, step, identity}; }
  // "shardkit allreduce #5 (rank 3): "
  std::string where() const {
    return std::string("shardkit ") + op + " #" + std::to_string(seq) + " (rank " + std::to_string(global_rank) +
           "): ";
  }
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual void barrier(const OpContext& op) = 0;
  virtual void broadcast(const OpContext& op, at::Tensor& data, int root) = 0;
  virtual void allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) = 0;
  // The backend's AVG of a host tensor: allreduce (SUM), then every element divided by `divisor` (integers
  // toward zero, core::divide_in_place's bits). This default reduces, then divides in a pass of its own; the
  // shm engine divides inside the reduction, each slice once before it is shared (the same bits, one pass
  // over the data fewer).
  virtual void allreduce_average(const OpContext& op, at::Tensor& data, int64_t divisor);
  // Writes the result into root's `data` only; other ranks' tensors are left as they were.
  virtual void reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) = 0;
  // output: size * input.numel() elements, rank r's input at r * input.numel().
  virtual void allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) = 0;
  // As allgather, but only root's output is written; other ranks pass an undefined tensor.
  virtual void gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) = 0;
  // root's input: size * output.numel() elements; other ranks pass an undefined tensor.
  virtual void scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) = 0;
  // input: size * output.numel() elements; rank r gets the reduction of every rank's block r.
  virtual void reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                              core::ReduceOp reduce) = 0;
  // send_counts[j] elements of input (packed in rank order) go to rank j; recv_counts[j] elements from rank j
  // land in output, packed in rank order.
  virtual void alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                        at::Tensor& output, const std::vector<size_t>& recv_counts) = 0;

  // Zero-copy buffers (core::SharedBuffer): collective; every rank gets a region of `bytes` that the engine
  // reads from the peers' regions when an allreduce's tensor or a reduce-scatter's input lies in it. Null where
  // the engine has no such memory (ranks on several hosts), or, with the reason in `*refused`, no room for it
  // (/dev/shm): every rank of the group gets the same answer. Tensors elsewhere take the ordinary path, with the same results.
  virtual std::shared_ptr<core::SharedBuffer> share_buffer(const OpContext& op, size_t bytes, std::string* refused) {
    (void)op;
    (void)bytes;
    (void)refused;
    return nullptr;
  }
  // Collectives that read their input from such a buffer (for tests and benchmarks).
  virtual uint64_t shared_ops() const { return 0; }
  // Payload bytes this rank has sent to other hosts in point-to-point exchanges: every rails op, every
  // reduce-scatter and every quantized op crosses that way (the leader scheme's exact allreduce, all-gather,
  // broadcast, reduce and barrier run as gloo collectives and are not counted). 0 where no byte leaves the host.
  virtual uint64_t inter_host_bytes() const { return 0; }

  // Aborts the engine for good from any thread, also while an op runs on it: that op and every later one fail
  // with `reason`, and so do the peers' (the shm group's abort wakes this host's ranks; other hosts learn through
  // the closed connections and the group's Store notice). Idempotent: the first reason stands.
  virtual void abort(const std::string& reason) = 0;
  // The ranks (global rank, pid) this rank saw exit in the op that failed, handed over once
  // (core::ShmGroup::take_exited_peers).
  virtual std::vector<std::pair<int, int32_t>> take_exited_peers() = 0;

  // destroy_process_group(): release what the engine alone holds (idempotent; nothing runs afterwards). The
  // backend shuts the shared InnerBackends down itself.
  virtual void shutdown() {}
};

// An exception's message as a user should read it (a c10::Error's without its C++ backtrace).
std::string message_of(const std::exception& error);

// The core dtype of a tensor the backend has validated.
core::DType core_dtype(const at::Tensor& tensor);

// A tensor's element count, as the core's loops and the shared-memory ops count.
inline size_t numel_of(const at::Tensor& tensor) { return static_cast<size_t>(tensor.numel()); }

// A contiguous tensor's bytes, as a flat uint8 tensor sharing its storage (gloo moves them as they are).
at::Tensor as_bytes(const at::Tensor& tensor);

}  // namespace shardkit::comm

// NcclEngine: the shardkit backend's collectives on CUDA tensors through NCCL (CUDA builds only).
//
// It is an Engine (comm/engine.h) like the host engines: each method queues its NCCL calls on the CUDA stream
// current when it is called, which CudaRoute (cuda_route.h) has made the group's communication stream, and
// returns without waiting; CudaWatchdog (cuda_watchdog.h) then follows the op to its end on the device.
//
// The communicator is created by the first CUDA op of the group, on every rank at the same op (ops run in
// issue order on every rank): the ranks exchange their GPUs' UUIDs and rank 0's ncclUniqueId through the host
// engine (one allgather and one broadcast, steps of that op), then call ncclCommInitRankConfig with a
// non-blocking config, so that a wait can give up and ncclCommAbort returns. If two ranks of the group share
// a GPU (NCCL refuses that) or NCCL cannot be set up, the engine reports itself unusable and CudaRoute sends
// the group's CUDA ops through host memory instead.
//
// Failures are errors, not hangs: a call that stays ncclInProgress is polled until the op's deadline; on an
// NCCL error, at the deadline, or when the watchdog calls abort(), the communicator is aborted and the first
// reason kept: later ops fail at once with it. Every use of the communicator holds `mutex_`, so the
// watchdog's abort never frees it under a call of the worker thread.
//
// What NCCL lacks goes through `staged` (host memory), op by op: bitwise reductions of integers, BXOR of bool.
#pragma once

#include <ATen/ATen.h>
#include <nccl.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>

#include "comm/engine.h"

namespace shardkit::comm {

class NcclEngine final : public Engine {
 public:
  // `host` runs the set-up exchange; `staged` serves what NCCL lacks. Both outlive this engine.
  NcclEngine(int rank, int size, Engine& host, Engine& staged);
  ~NcclEngine() override;

  // Whether NCCL serves this group's CUDA ops on `device`. The first call (a collective: every rank makes it
  // at the same op) sets the communicator up; an empty reason means usable, otherwise it says why not.
  const std::string& unusable_reason(const OpContext& op, const at::Device& device);
  // What carries this group's CUDA ops, for users asking why they are slow: "nccl", "host shared memory: <why>",
  // or that no CUDA op has run yet.
  std::string describe() const;
  // The watchdog's view: "" while the communicator is well, else why not (an asynchronous NCCL error, or the
  // group's first failure).
  std::string health() const;
  // Aborts the communicator (any thread), keeping `reason` as the group's failure if it is the first. The
  // failure is recorded before NCCL is told, so an op that NCCL cuts short is seen failed, never done.
  void abort(const std::string& reason) override;
  // NCCL reports errors, not which peer exited.
  std::vector<std::pair<int, int32_t>> take_exited_peers() override { return {}; }

  void barrier(const OpContext& op) override;
  void broadcast(const OpContext& op, at::Tensor& data, int root) override;
  void allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) override;
  void reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) override;
  void allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) override;
  void gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) override;
  void reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                      core::ReduceOp reduce) override;
  void alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                at::Tensor& output, const std::vector<size_t>& recv_counts) override;
  void shutdown() override;

 private:
  class GroupCalls;  // the calls of one ncclGroupStart/End (nccl_engine.cpp)

  // The exchange and the communicator; returns why NCCL cannot serve ("" when it can).
  std::string set_up(const OpContext& op, const at::Device& device);
  // Runs `call(comm)` holding the lock; raises the group's failure instead if the communicator was aborted.
  template <typename Call>
  ncclResult_t with_comm(const OpContext& op, Call call);
  // Checks an NCCL call's result: waits out ncclInProgress (a non-blocking communicator), and on an error
  // aborts the communicator and throws naming `what`.
  void check(const OpContext& op, ncclResult_t result, const char* what);
  // Polls the communicator until it leaves ncclInProgress; throws (after aborting) on an error or the deadline.
  void settle(const OpContext& op, const char* what);
  [[noreturn]] void fail(const OpContext& op, const std::string& reason);
  // One NCCL group: add_calls(calls, comm) with the lock held throughout, then the results checked.
  template <typename AddCalls>
  void grouped(const OpContext& op, const char* what, AddCalls add_calls);
  cudaStream_t stream() const;

  int rank_;
  int size_;
  Engine& host_;
  Engine& staged_;
  mutable std::mutex mutex_;  // guards comm_, failure_, set_up_ and unusable_ (the watchdog and describe() read them)
  ncclComm_t comm_ = nullptr;
  bool attempted_ = false;  // the worker thread began the set-up (only it reads this)
  bool set_up_ = false;    // the set-up finished and unusable_ holds its verdict
  std::string unusable_;  // why NCCL does not serve this group ("" when it does)
  std::string failure_;   // the first failure; later ops fail with it
};

}  // namespace shardkit::comm

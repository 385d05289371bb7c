// CudaRoute: how the shardkit backend runs an op on CUDA tensors (CUDA builds only).
//
// On the calling thread, at issue, ready_after() records an event on the caller's current stream of the
// tensors' device: the op must see what the caller queued before it, and the caller is not blocked. On the
// worker thread, run() makes the group's communication stream (one per process, from torch's pool) current,
// has it wait for that event, and runs the op's body on the engine that serves CUDA tensors:
//   - NcclEngine (NCCL on the communication stream) when every rank of the group has its own GPU;
//   - HostStagedEngine (device -> host -> shared memory -> device) otherwise, with a one-time warning naming
//     the reason (two ranks on one GPU, which NCCL refuses, or NCCL could not be set up).
// run() returns once the op is queued: the Work is marked issued on the communication stream (its Future's
// events and wait() order the caller's streams after the op; the host does not wait), and the watchdog
// (cuda_watchdog.h) follows the op to its end on the device, holding its tensors until then (no
// recordStream), aborting the communicator and failing the op past its deadline or on an NCCL error.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "comm/engine.h"
#include "comm/nccl/host_staged_engine.h"
#include "comm/nccl/cuda_watchdog.h"
#include "comm/nccl/nccl_engine.h"
#include "comm/work_queue.h"

namespace shardkit::comm {

// What an op on CUDA tensors waits for before it runs: an event recorded on the caller's current stream at
// issue. (A plain cudaEvent_t: ATen's CUDAEvent header pulls in cuSPARSE's, which a bare CUDA toolkit lacks.)
struct CudaReady {
  CudaReady(const at::Device& device, cudaStream_t caller);
  ~CudaReady();
  CudaReady(const CudaReady&) = delete;
  CudaReady& operator=(const CudaReady&) = delete;

  at::Device device;
  cudaEvent_t event = nullptr;
};

class CudaRoute {
 public:
  // `host`: the group's shared-memory or hierarchical engine (it outlives this route).
  CudaRoute(int rank, int size, Engine& host);

  // Calling thread, before the op is queued. All CUDA tensors of one op are on one device (TensorArgs checked
  // it); that device must be the one this process's earlier CUDA ops used, or this raises now, naming both:
  // failing here, not on the worker, keeps the other ranks from waiting for an op this rank never runs.
  std::shared_ptr<CudaReady> ready_after(const std::vector<at::Tensor>& tensors, const char* op, int rank);
  // Worker thread: body(engine) as described above; returns once the op is queued on the device, `work`
  // issued and handed to the watchdog with `keep_alive` (what holds the op's tensors).
  void run(const OpContext& op, const CudaReady& ready, const std::function<void(Engine&)>& body,
           const c10::intrusive_ptr<ShardkitWork>& work, std::shared_ptr<void> keep_alive);
  // After the worker has stopped: waits for the ops in flight (each until its deadline), then frees NCCL.
  void shutdown();
  // Any thread: the group failed elsewhere (its host engine, or another group of the process: abort_cascade.h).
  // NCCL is aborted with `reason`, so its ops in flight and every later one fail with it.
  void abort(const std::string& reason) { nccl_.abort(reason); }
  std::string describe() const { return nccl_.describe(); }

 private:
  HostStagedEngine staged_;
  NcclEngine nccl_;
  std::optional<c10::cuda::CUDAStream> stream_;  // the communication stream, made on the first CUDA op
  std::optional<at::Device> device_;             // the GPU of this process's CUDA ops (set at the first issue)
  CudaWatchdog watchdog_;                        // last: stopped before the engines it reports to go
};

}  // namespace shardkit::comm

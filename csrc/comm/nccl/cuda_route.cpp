#include "comm/nccl/cuda_route.h"

#include <c10/cuda/CUDAGuard.h>

namespace shardkit::comm {

CudaReady::CudaReady(const at::Device& where, cudaStream_t caller) : device(where) {
  const c10::cuda::CUDAGuard guard(device);
  cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status == cudaSuccess) status = cudaEventRecord(event, caller);
  TORCH_CHECK(status == cudaSuccess, "shardkit: recording the caller's stream for a CUDA collective failed: ",
              cudaGetErrorString(status));
}

CudaReady::~CudaReady() {
  if (event != nullptr) cudaEventDestroy(event);
}

CudaRoute::CudaRoute(int rank, int size, Engine& host)
    : staged_(host),
      nccl_(rank, size, host, staged_),
      watchdog_([this] { return nccl_.health(); }, [this](const std::string& reason) { nccl_.abort(reason); }) {}

std::shared_ptr<CudaReady> CudaRoute::ready_after(const std::vector<at::Tensor>& tensors, const char* op, int rank) {
  for (const at::Tensor& tensor : tensors) {
    if (tensor.defined() && tensor.is_cuda()) {
      const at::Device device = tensor.device();
      if (!device_) device_ = device;
      TORCH_CHECK(*device_ == device, "shardkit ", op, " (rank ", rank, "): tensors on ", device, ", but this "
                  "process's earlier CUDA collectives ran on ", *device_, ": shardkit drives one GPU per process");
      return std::make_shared<CudaReady>(device, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    }
  }
  TORCH_INTERNAL_ASSERT(false, "CudaRoute::ready_after: no CUDA tensor");
}

void CudaRoute::run(const OpContext& op, const CudaReady& ready, const std::function<void(Engine&)>& body,
                    const c10::intrusive_ptr<ShardkitWork>& work, std::shared_ptr<void> keep_alive) {
  const c10::cuda::CUDAGuard device_guard(ready.device);
  if (!stream_) stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, ready.device.index());
  const c10::cuda::CUDAStreamGuard stream_guard(*stream_);
  const cudaError_t waited = cudaStreamWaitEvent(stream_->stream(), ready.event, 0);
  TORCH_CHECK(waited == cudaSuccess, op.where(), "cudaStreamWaitEvent failed: ", cudaGetErrorString(waited));
  try {
    const std::string& unusable = nccl_.unusable_reason(op, ready.device);
    if (!unusable.empty()) {
      TORCH_WARN_ONCE("shardkit: CUDA collectives of this group go through host shared memory (device -> host -> "
                      "shm -> device; slow but correct) because ", unusable, ".");
      body(staged_);  // its host steps waited for their copies; the copies back are queued on the stream
    } else {
      body(nccl_);
    }
    work->issued_on(*stream_);
  } catch (...) {
    // The op fails, but some of its device work may be queued already (a copy, an NCCL call before the one
    // that failed): its tensors stay referenced until that has run.
    watchdog_.hold(op, *stream_, std::move(keep_alive));
    throw;
  }
  watchdog_.watch(op, ready.device, work, std::move(keep_alive));
}

void CudaRoute::shutdown() {
  watchdog_.stop();
  nccl_.shutdown();
}

}  // namespace shardkit::comm

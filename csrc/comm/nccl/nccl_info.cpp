// NCCL facts for diagnostics (`shardkit._C.nccl_version()`); the NCCL collectives build on this folder.
#include <nccl.h>

#include <c10/util/Exception.h>

#include "cuda/cuda_ops.h"

namespace shardkit::cuda {

int nccl_version() {
  int version = 0;
  const ncclResult_t result = ncclGetVersion(&version);
  TORCH_CHECK(result == ncclSuccess, "shardkit: ncclGetVersion failed: ", ncclGetErrorString(result));
  return version;
}

}  // namespace shardkit::cuda

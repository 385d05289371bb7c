#include <nccl.h>

#include <c10/util/Exception.h>

#include "comm/nccl/nccl_info.h"

namespace shardkit::comm {

int nccl_version() {
  int version = 0;
  const ncclResult_t result = ncclGetVersion(&version);
  TORCH_CHECK(result == ncclSuccess, "shardkit: ncclGetVersion failed: ", ncclGetErrorString(result));
  return version;
}

}  // namespace shardkit::comm

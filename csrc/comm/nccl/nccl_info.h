// NCCL facts for diagnostics (CUDA builds only).
#pragma once

namespace shardkit::comm {

// The version of the NCCL library shardkit linked, as NCCL encodes it (e.g. 22805 for 2.28.5).
int nccl_version();

}  // namespace shardkit::comm

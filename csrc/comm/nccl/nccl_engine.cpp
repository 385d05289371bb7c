#include "comm/nccl/nccl_engine.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <thread>

namespace shardkit::comm {

namespace {

ncclDataType_t nccl_dtype(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kByte:
    case at::kBool: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default: TORCH_CHECK(false, "shardkit NCCL engine: unvalidated dtype ", tensor.scalar_type());
  }
}

// NCCL's op for a reduction, if it has one. Bool: OR is MAX and AND is MIN (as the host engines compute them).
std::optional<ncclRedOp_t> nccl_op(core::ReduceOp reduce, const at::Tensor& tensor) {
  const bool is_bool = tensor.scalar_type() == at::kBool;
  switch (reduce) {
    case core::ReduceOp::Sum: return is_bool ? ncclMax : ncclSum;
    case core::ReduceOp::Product: return is_bool ? ncclMin : ncclProd;
    case core::ReduceOp::Min: return ncclMin;
    case core::ReduceOp::Max: return ncclMax;
    case core::ReduceOp::BAnd: return is_bool ? std::optional<ncclRedOp_t>(ncclMin) : std::nullopt;
    case core::ReduceOp::BOr: return is_bool ? std::optional<ncclRedOp_t>(ncclMax) : std::nullopt;
    case core::ReduceOp::BXor: return std::nullopt;
  }
  return std::nullopt;
}

char* bytes_at(const at::Tensor& tensor, size_t elements) {
  return static_cast<char*>(tensor.data_ptr()) + elements * tensor.element_size();
}

std::string uuid_text(const unsigned char* bytes) {
  static const char* digits = "0123456789abcdef";
  std::string text;
  for (int i = 0; i < 16; ++i) {
    text += digits[bytes[i] >> 4];
    text += digits[bytes[i] & 15];
  }
  return "GPU-" + text;
}

}  // namespace

// The calls of one NCCL group: the first error among them (inside a group NCCL defers most of its work to
// ncclGroupEnd, whose result is checked on its own) and the device copies of a rank's own block.
class NcclEngine::GroupCalls {
 public:
  // Opens the group (ncclGroupStart's result: started()); a group still open when this is destroyed (something
  // threw between the calls) is closed, so later NCCL calls on this thread are not silently deferred.
  explicit GroupCalls(cudaStream_t stream) : stream_(stream), started_(ncclGroupStart()) {}
  ~GroupCalls() {
    if (open()) ncclGroupEnd();
  }
  GroupCalls(const GroupCalls&) = delete;
  GroupCalls& operator=(const GroupCalls&) = delete;
  ncclResult_t started() const { return started_; }
  ncclResult_t end() {
    ended_ = true;
    return ncclGroupEnd();
  }
  void add(ncclResult_t result) {
    if (first_ == ncclSuccess && result != ncclSuccess && result != ncclInProgress) first_ = result;
  }
  void copy(void* to, const void* from, size_t bytes) {
    const cudaError_t status = cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_);
    if (copy_error_ == cudaSuccess) copy_error_ = status;
  }
  ncclResult_t first_error() const { return first_; }
  cudaError_t copy_error() const { return copy_error_; }

 private:
  bool open() const { return !ended_ && (started_ == ncclSuccess || started_ == ncclInProgress); }

  cudaStream_t stream_;
  ncclResult_t started_;
  bool ended_ = false;
  ncclResult_t first_ = ncclSuccess;
  cudaError_t copy_error_ = cudaSuccess;
};

NcclEngine::NcclEngine(int rank, int size, Engine& host, Engine& staged)
    : rank_(rank), size_(size), host_(host), staged_(staged) {}

NcclEngine::~NcclEngine() { shutdown(); }

cudaStream_t NcclEngine::stream() const { return c10::cuda::getCurrentCUDAStream().stream(); }

const std::string& NcclEngine::unusable_reason(const OpContext& op, const at::Device& device) {
  if (!attempted_) {
    attempted_ = true;  // one attempt (worker thread only): a failure below fails this op, later ones say why
    try {
      std::string reason = set_up(op, device);
      std::lock_guard<std::mutex> lock(mutex_);
      unusable_ = std::move(reason);
      set_up_ = true;
    } catch (const std::exception& error) {
      abort(std::string("setting up NCCL failed: ") + error.what());
      throw;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(failure_.empty(), op.where(), "the NCCL communicator failed earlier: ", failure_);
  return unusable_;  // written once, by this thread, before any reader could see set_up_
}

std::string NcclEngine::describe() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_.empty()) return "failed: " + failure_;
  if (!set_up_) return "undecided: no CUDA collective has run on this group yet";
  return unusable_.empty() ? "nccl" : "host shared memory: " + unusable_;
}

std::string NcclEngine::set_up(const OpContext& op, const at::Device& device) {
  // 1. Which GPU each rank drives: NCCL refuses two ranks on one GPU.
  cudaDeviceProp properties{};
  const cudaError_t status = cudaGetDeviceProperties(&properties, device.index());
  TORCH_CHECK(status == cudaSuccess, op.where(), "cudaGetDeviceProperties(", device.index(), ") failed: ",
              cudaGetErrorString(status));
  at::Tensor mine = at::empty({16}, at::kByte);
  std::memcpy(mine.data_ptr(), properties.uuid.bytes, 16);
  at::Tensor everyone = at::empty({16 * size_}, at::kByte);
  host_.allgather(op, mine, everyone);
  const auto* uuids = everyone.data_ptr<unsigned char>();
  for (int a = 0; a < size_; ++a) {
    for (int b = a + 1; b < size_; ++b) {
      if (std::memcmp(uuids + 16 * a, uuids + 16 * b, 16) == 0) {  // every rank saw the same: decides the same
        return "ranks " + std::to_string(a) + " and " + std::to_string(b) + " of the group share " +
               uuid_text(uuids + 16 * a) + ", and NCCL needs one GPU per rank";
      }
    }
  }
  // 2. Rank 0's unique id, with a flag saying whether it could make one.
  at::Tensor payload = at::zeros({1 + static_cast<int64_t>(sizeof(ncclUniqueId))}, at::kByte);
  if (rank_ == 0) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) == ncclSuccess) {
      payload.data_ptr<uint8_t>()[0] = 1;
      std::memcpy(payload.data_ptr<uint8_t>() + 1, &id, sizeof(id));
    }
  }
  host_.broadcast(op, payload, 0);
  if (payload.data_ptr<uint8_t>()[0] == 0) return "rank 0 could not create an NCCL unique id (ncclGetUniqueId failed)";
  ncclUniqueId id;
  std::memcpy(&id, payload.data_ptr<uint8_t>() + 1, sizeof(id));
  // 3. The communicator, non-blocking: its creation and every op can be waited for with a deadline, and
  //    ncclCommAbort from this thread returns.
  const c10::cuda::CUDAGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    comm_ = comm;
  }
  check(op, result, "ncclCommInitRankConfig");
  return "";
}

void NcclEngine::check(const OpContext& op, ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) {
    settle(op, what);
    return;
  }
  std::string detail;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ != nullptr) detail = std::string(" (") + ncclGetLastError(comm_) + ")";
  }
  fail(op, std::string(what) + " failed: " + ncclGetErrorString(result) + detail);
}

template <typename Call>
ncclResult_t NcclEngine::with_comm(const OpContext& op, Call call) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(failure_.empty() && comm_ != nullptr, op.where(), "the NCCL communicator was aborted: ",
              failure_.empty() ? std::string("(no reason recorded)") : failure_);
  return call(comm_);
}

void NcclEngine::settle(const OpContext& op, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + op.timeout;
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = with_comm(op, [&](ncclComm_t comm) { return ncclCommGetAsyncError(comm, &state); });
    if (queried != ncclSuccess) state = queried;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(op, std::string(what) + " failed: " + ncclGetErrorString(state));
    if (std::chrono::steady_clock::now() > deadline) {
      fail(op, std::string(what) + " did not finish within " + std::to_string(op.timeout.count()) + " ms");
    }
    if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string NcclEngine::health() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_.empty()) return "the NCCL communicator failed: " + failure_;
  if (comm_ == nullptr) return "";
  ncclResult_t state = ncclSuccess;
  const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
  if (queried != ncclSuccess) state = queried;
  if (state == ncclSuccess || state == ncclInProgress) return "";
  return std::string("NCCL reported an error while the collective ran: ") + ncclGetErrorString(state) + " (" +
         ncclGetLastError(comm_) + ")";
}

void NcclEngine::abort(const std::string& reason) {
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = reason;
    std::swap(comm, comm_);
  }
  // Outside the lock: ncclCommAbort waits for NCCL's own streams (behind the communication stream, which may
  // wait on a busy caller stream) and frees device memory; nobody else should wait on that. No NCCL call can be
  // in progress on `comm`: each one holds the lock, and the next finds comm_ null.
  if (comm != nullptr) ncclCommAbort(comm);
}

void NcclEngine::fail(const OpContext& op, const std::string& reason) {
  abort(std::string(op.op) + " #" + std::to_string(op.seq) + ": " + reason);
  TORCH_CHECK(false, op.where(), reason, "; the NCCL communicator was aborted");
}

void NcclEngine::shutdown() {
  // Every op has ended by now (the worker stopped, the watchdog drained): this only frees the communicator.
  abort("the process group was shut down (destroy_process_group)");
}

// --- collectives ------------------------------------------------------------------------------------------

void NcclEngine::barrier(const OpContext& op) { host_.barrier(op); }

void NcclEngine::broadcast(const OpContext& op, at::Tensor& data, int root) {
  if (data.numel() == 0) return;
  check(op, with_comm(op, [&](ncclComm_t comm) {
          return ncclBroadcast(data.data_ptr(), data.data_ptr(), numel_of(data), nccl_dtype(data), root, comm, stream());
        }), "ncclBroadcast");
}

void NcclEngine::allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  const auto nop = nccl_op(reduce, data);
  if (!nop) return staged_.allreduce(op, data, reduce);
  if (data.numel() == 0) return;
  check(op, with_comm(op, [&](ncclComm_t comm) {
          return ncclAllReduce(data.data_ptr(), data.data_ptr(), numel_of(data), nccl_dtype(data), *nop, comm, stream());
        }), "ncclAllReduce");
}

void NcclEngine::reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) {
  const auto nop = nccl_op(reduce, data);
  if (!nop) return staged_.reduce(op, data, reduce, root);
  if (data.numel() == 0) return;
  // NCCL writes the receive buffer on the root only: the others' tensors stay as they were (the Engine rule).
  check(op, with_comm(op, [&](ncclComm_t comm) {
          return ncclReduce(data.data_ptr(), data.data_ptr(), numel_of(data), nccl_dtype(data), *nop, root, comm,
                            stream());
        }), "ncclReduce");
}

void NcclEngine::allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  if (input.numel() == 0) return;
  check(op, with_comm(op, [&](ncclComm_t comm) {
          return ncclAllGather(input.data_ptr(), output.data_ptr(), numel_of(input), nccl_dtype(input), comm, stream());
        }), "ncclAllGather");
}

void NcclEngine::reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                core::ReduceOp reduce) {
  const auto nop = nccl_op(reduce, output);
  if (!nop) return staged_.reduce_scatter(op, input, output, reduce);
  if (output.numel() == 0) return;
  check(op, with_comm(op, [&](ncclComm_t comm) {
          return ncclReduceScatter(input.data_ptr(), output.data_ptr(), numel_of(output), nccl_dtype(output), *nop,
                                   comm, stream());
        }), "ncclReduceScatter");
}

// gather, scatter and all-to-all: point-to-point calls in one NCCL group; a rank's own block is a device copy.
// The lock is held for the whole group (NCCL wants one thread to issue all calls of a group, and an abort must
// not free the communicator between them); the results are checked after it is released, since waiting out
// ncclInProgress takes the lock again.
template <typename AddCalls>
void NcclEngine::grouped(const OpContext& op, const char* what, AddCalls add_calls) {
  ncclResult_t started = ncclSuccess, first = ncclSuccess, ended = ncclSuccess;
  cudaError_t copy_error = cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(failure_.empty() && comm_ != nullptr, op.where(), "the NCCL communicator was aborted: ",
                failure_.empty() ? std::string("(no reason recorded)") : failure_);
    GroupCalls calls(stream());
    started = calls.started();
    if (started == ncclSuccess || started == ncclInProgress) {
      add_calls(calls, comm_);
      ended = calls.end();  // closes the group, even after a failed call inside it
    }
    first = calls.first_error();
    copy_error = calls.copy_error();
  }
  check(op, started, "ncclGroupStart");
  check(op, first, what);
  check(op, ended, what);
  if (copy_error != cudaSuccess) {
    fail(op, std::string(what) + ": the device copy of this rank's own block failed: " + cudaGetErrorString(copy_error));
  }
}

void NcclEngine::gather(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  const size_t n = numel_of(input);
  if (n == 0) return;
  const ncclDataType_t dtype = nccl_dtype(input);
  const size_t bytes = n * input.element_size();
  grouped(op, "gather (ncclSend/ncclRecv group)", [&](GroupCalls& calls, ncclComm_t comm) {
    if (rank_ != root) {
      calls.add(ncclSend(input.data_ptr(), n, dtype, root, comm, stream()));
      return;
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        calls.copy(bytes_at(output, n * r), input.data_ptr(), bytes);
      } else {
        calls.add(ncclRecv(bytes_at(output, n * r), n, dtype, r, comm, stream()));
      }
    }
  });
}

void NcclEngine::scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output, int root) {
  const size_t n = numel_of(output);
  if (n == 0) return;
  const ncclDataType_t dtype = nccl_dtype(output);
  grouped(op, "scatter (ncclSend/ncclRecv group)", [&](GroupCalls& calls, ncclComm_t comm) {
    if (rank_ != root) {
      calls.add(ncclRecv(output.data_ptr(), n, dtype, root, comm, stream()));
      return;
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        calls.copy(output.data_ptr(), bytes_at(input, n * r), n * output.element_size());
      } else {
        calls.add(ncclSend(bytes_at(input, n * r), n, dtype, r, comm, stream()));
      }
    }
  });
}

void NcclEngine::alltoall(const OpContext& op, const at::Tensor& input, const std::vector<size_t>& send_counts,
                          at::Tensor& output, const std::vector<size_t>& recv_counts) {
  const ncclDataType_t dtype = nccl_dtype(input);
  grouped(op, "all-to-all (ncclSend/ncclRecv group)", [&](GroupCalls& calls, ncclComm_t comm) {
    size_t send_offset = 0, recv_offset = 0;
    for (int r = 0; r < size_; ++r) {
      const size_t out = send_counts[r], in = recv_counts[r];
      if (r == rank_) {
        if (out > 0) calls.copy(bytes_at(output, recv_offset), bytes_at(input, send_offset), out * input.element_size());
      } else {
        if (out > 0) calls.add(ncclSend(bytes_at(input, send_offset), out, dtype, r, comm, stream()));
        if (in > 0) calls.add(ncclRecv(bytes_at(output, recv_offset), in, dtype, r, comm, stream()));
      }
      send_offset += out;
      recv_offset += in;
    }
  });
}

}  // namespace shardkit::comm

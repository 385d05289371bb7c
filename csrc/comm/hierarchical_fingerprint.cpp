// The host leaders' agreement check of HierarchicalEngine (hierarchical_engine.h, "Between hosts gloo checks
// nothing"): before an op's inter-host steps on a group that compares identities, the leaders all-gather a fixed-size
// Fingerprint (number, kind, dtype, count, collective identity, wire formats, name) and compare it.
//
// Promise: the exchange is issued as the op begins and waited for just before its first inter-host step
// (inter_host_for), so it overlaps the op's in-host step; ranks in different ops, or moving different parts of a
// model, fail there with an error naming both sides.
#include "comm/hierarchical_engine.h"

#include <cstring>

#include "comm/hierarchical_internal.h"
#include "core/collective_identity.h"

namespace shardkit::comm {

using namespace hierarchical;

std::string HierarchicalEngine::Fingerprint::describe() const {
  const Fingerprint& f = *this;
  std::string text = std::string(f.label, strnlen(f.label, sizeof(f.label))) + " #" + std::to_string(f.seq);
  if (static_cast<core::OpKind>(f.kind) != core::OpKind::Barrier) {
    text += std::string(" (") + core::dtype_name(static_cast<core::DType>(f.dtype)) + " x " + std::to_string(f.count) + ")";
  }
  if (f.identity != 0) text += " for " + core::describe_identity(f.identity);
  if (f.gather_wire != 0 || f.reduce_wire != 0) {
    auto format = [](uint32_t packed) {
      return core::QuantFormat{static_cast<core::QuantBits>(packed & 0xFF), packed >> 8}.describe();
    };
    text += ", inter-host bytes: all-gathers " + format(f.gather_wire) + ", sums " + format(f.reduce_wire);
  }
  return text;
}

void HierarchicalEngine::start_fingerprint(const OpContext& op, const LeaderStep& step) {
  PendingFingerprint pending;
  Fingerprint& mine = pending.mine;
  mine.seq = op.seq;
  mine.identity = op.identity;
  mine.count = step.count;
  mine.kind = static_cast<uint32_t>(step.kind);
  mine.dtype = static_cast<uint32_t>(step.dtype);
  auto packed = [](core::QuantFormat format) {
    return format.exact() ? 0u : static_cast<uint32_t>(format.bits) | (format.block << 8);
  };
  mine.gather_wire = packed(op.quantization.gather);
  mine.reduce_wire = packed(op.quantization.reduce);
  std::strncpy(mine.label, op.op, sizeof(mine.label) - 1);
  if (!fingerprint_in_.defined()) {  // the first: the sizes are the group's for good
    fingerprint_in_ = at::empty({static_cast<int64_t>(sizeof(Fingerprint))}, at::kByte);
    fingerprint_everyone_ = at::empty({static_cast<int64_t>(hosts_.size() * sizeof(Fingerprint))}, at::kByte);
  }
  std::memcpy(fingerprint_in_.data_ptr(), &mine, sizeof(Fingerprint));
  c10d::AllgatherOptions options;
  options.timeout = op.timeout;
  pending.backend = inner_->inter_host(op.where());
  pending.work = pending.backend->_allgather_base(fingerprint_everyone_, fingerprint_in_, options);
  fingerprint_ = std::move(pending);
}

void HierarchicalEngine::abandon_fingerprint() {
  if (!fingerprint_) return;
  if (!fingerprint_->work->isCompleted()) InnerBackends::abandon(std::move(fingerprint_->backend));
  fingerprint_.reset();
}

void HierarchicalEngine::settle_fingerprint(const OpContext& op) {
  if (!fingerprint_) return;
  PendingFingerprint pending = std::move(*fingerprint_);
  fingerprint_.reset();
  wait_inner(op, "the host leaders' agreement check (gloo)", pending.backend, pending.work);
  const auto* theirs = static_cast<const Fingerprint*>(fingerprint_everyone_.data_ptr());
  for (size_t h = 0; h < hosts_.size(); ++h) {
    if (std::memcmp(&theirs[h], &pending.mine, sizeof(Fingerprint)) == 0) continue;
    throw std::runtime_error("shardkit: ranks disagree on collective #" + std::to_string(op.seq) + ": rank " +
                             std::to_string(op.global_rank) + " called " + pending.mine.describe() + " but rank " +
                             std::to_string(notices_->global_rank(hosts_[h].front())) + " called " +
                             theirs[h].describe());
  }
}

c10::intrusive_ptr<c10d::Backend> HierarchicalEngine::inter_host_for(const OpContext& op) {
  settle_fingerprint(op);
  return inner_->inter_host(op.where());
}

}  // namespace shardkit::comm

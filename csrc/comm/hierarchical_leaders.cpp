// The leader scheme of HierarchicalEngine (hierarchical_engine.h has each op's steps): the ranks of a host meet in
// shared memory, and only its leader (local rank 0) crosses to the other hosts, as a gloo collective among the
// leaders or, for reduce-scatters and quantized steps, as a point-to-point exchange. Barrier, broadcast and reduce
// always run this way; allreduce, all-gather and reduce-scatter when the op is small or the group has no rails.
//
// Promise: every host runs the same in-host steps for a given op, whatever its rank's role, and a leader's inter-host
// step starts only once the op's fingerprints agree (inter_host_for). Sums over hosts are taken in host order, so
// every rank gets the same bits.
#include "comm/hierarchical_engine.h"

#include <vector>

#include "comm/hierarchical_internal.h"
#include "core/reduce.h"

namespace shardkit::comm {

using namespace hierarchical;

namespace {

// The c10d op that combines hosts' partial results like `op` combines ranks' inputs.
c10d::ReduceOp::RedOpType c10d_op(core::ReduceOp op) {
  switch (op) {
    case core::ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case core::ReduceOp::Product: return c10d::ReduceOp::PRODUCT;
    case core::ReduceOp::Min: return c10d::ReduceOp::MIN;
    case core::ReduceOp::Max: return c10d::ReduceOp::MAX;
    case core::ReduceOp::BAnd: return c10d::ReduceOp::BAND;
    case core::ReduceOp::BOr: return c10d::ReduceOp::BOR;
    case core::ReduceOp::BXor: return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::UNUSED;
}

// gloo has no bool: bools travel as 0/1 bytes, combined with an op that keeps them 0/1 (a sum of bools is
// their OR, a product their AND, as in the shm engine's reduction loops).
c10d::ReduceOp::RedOpType c10d_op_for_bool(core::ReduceOp op) {
  switch (op) {
    case core::ReduceOp::Sum: return c10d::ReduceOp::MAX;
    case core::ReduceOp::Product: return c10d::ReduceOp::MIN;
    default: return c10d_op(op);
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> HierarchicalEngine::start_allreduce(const OpContext& op, c10d::Backend& backend,
                                                                   at::Tensor& data, core::ReduceOp reduce) {
  const bool is_bool = data.scalar_type() == at::kBool;
  std::vector<at::Tensor> payload{is_bool ? data.view(at::kByte) : data};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(is_bool ? c10d_op_for_bool(reduce) : c10d_op(reduce));
  options.timeout = op.timeout;
  return backend.allreduce(payload, options);
}

void HierarchicalEngine::leaders_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(data);
  local_->reduce(data.data_ptr(), data.data_ptr(), numel_of(data), dtype, reduce, 0, in_host(op));
  if (leader() && data.numel() > 0) {
    if (!reduce_wire(op, data, reduce).exact()) {
      pipelined_allreduce(op, data, reduce, /*in_host_steps=*/false);
    } else {
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host allreduce (gloo among host leaders)", leaders,
                 start_allreduce(op, *leaders, data, reduce));
    }
  }
  local_->broadcast(data.data_ptr(), numel_of(data), dtype, 0, in_host(op));
}

void HierarchicalEngine::barrier(const OpContext& op) {
  guarded(op, LeaderStep{core::OpKind::Barrier, 0, core::DType::U8}, [&] {
    local_->barrier(in_host(op));
    if (leader()) {
      c10d::BarrierOptions options;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host barrier (gloo among host leaders)", leaders, leaders->barrier(options));
    }
    local_->barrier(in_host(op));  // nobody leaves before every host's leader has passed the inter-host step
  });
}

void HierarchicalEngine::broadcast(const OpContext& op, at::Tensor& data, int root) {
  guarded(op, LeaderStep{core::OpKind::Broadcast, numel_of(data), core_dtype(data)}, [&] {
    const int root_host = layout_.host_of[root];
    const core::DType dtype = core_dtype(data);
    if (host_ == root_host) local_->broadcast(data.data_ptr(), numel_of(data), dtype, layout_.local_of[root], in_host(op));
    if (leader() && data.numel() > 0) {
      std::vector<at::Tensor> payload{as_bytes(data)};
      c10d::BroadcastOptions options;
      options.rootRank = root_host;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host broadcast (gloo among host leaders)", leaders, leaders->broadcast(payload, options));
    }
    if (host_ != root_host) local_->broadcast(data.data_ptr(), numel_of(data), dtype, 0, in_host(op));
  });
}

void HierarchicalEngine::reduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce, int root) {
  guarded(op, LeaderStep{core::OpKind::Reduce, numel_of(data), core_dtype(data)}, [&] {
    const core::DType dtype = core_dtype(data);
    const int root_host = layout_.host_of[root];
    // The leader's partial result goes to a scratch buffer unless the leader is root: every rank's
    // tensor but root's must stay as it was.
    at::Tensor partial;
    if (leader()) partial = rank_ == root ? data : at::empty_like(data);
    local_->reduce(data.data_ptr(), partial.defined() ? partial.data_ptr() : nullptr, numel_of(data), dtype, reduce,
                   0, in_host(op));
    const Wire wire(reduce_wire(op, data, reduce), dtype);
    if (leader() && data.numel() > 0 && !wire.exact()) {
      // Quantized: every other host's leader sends its partial sum's record to root's host's leader, which sums
      // the hosts' partial sums in host order (its own exact).
      const int hosts = static_cast<int>(hosts_.size());
      std::vector<at::Tensor> to_peer(hosts - 1), from_peer(hosts - 1), theirs(hosts - 1);  // undefined: no transfer
      if (host_ == root_host) {
        for (int i = 0; i < hosts - 1; ++i) {
          theirs[i] = at::empty_like(partial);
          from_peer[i] = wire.landing(theirs[i]);
        }
      } else {
        to_peer[root_host < host_ ? root_host : root_host - 1] = wire.outgoing(partial);
      }
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce (gloo among host leaders)", leaders,
                 start_exchange(op, *leaders, to_peer, from_peer));
      if (host_ == root_host) {
        std::vector<const void*> sums;
        for (int h = 0, i = 0; h < hosts; ++h) {
          if (h == host_) {
            sums.push_back(partial.data_ptr());
            continue;
          }
          wire.arrived(from_peer[i], theirs[i]);
          sums.push_back(theirs[i++].data_ptr());
        }
        core::reduce_into(partial.data_ptr(), sums.data(), hosts, numel_of(partial), dtype, reduce);
      }
    } else if (leader() && data.numel() > 0) {
      const bool is_bool = data.scalar_type() == at::kBool;
      std::vector<at::Tensor> payload{is_bool ? partial.view(at::kByte) : partial};
      c10d::ReduceOptions options;
      options.reduceOp = c10d::ReduceOp(is_bool ? c10d_op_for_bool(reduce) : c10d_op(reduce));
      options.rootRank = root_host;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce (gloo among host leaders)", leaders, leaders->reduce(payload, options));
    }
    if (host_ == root_host && layout_.local_of[root] != 0) {
      // Hand the result from the leader to root; the host's other ranks receive it into scratch.
      at::Tensor landing = rank_ == root ? data : (leader() ? partial : at::empty_like(data));
      local_->broadcast(landing.data_ptr(), numel_of(landing), dtype, 0, in_host(op));
    }
  });
}

void HierarchicalEngine::leaders_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  const core::DType dtype = core_dtype(input);
  const int64_t n = input.numel();
  const int64_t block = static_cast<int64_t>(max_local_size_) * n;  // a host's share, padded to the largest host
  at::Tensor host_block;
  if (leader()) host_block = at::empty({block}, input.options());
  local_->gather(input.data_ptr(), leader() ? host_block.data_ptr() : nullptr, static_cast<size_t>(n), dtype, 0,
                 in_host(op));
  const core::QuantFormat format = gather_wire(op, input);
  if (leader() && n > 0 && !format.exact()) {
    // Each rank's block is quantized on its own, so its record decodes to the same values wherever it lands; the
    // leaders exchange their hosts' records and every host's are decoded into place, this host's too.
    const int hosts = static_cast<int>(hosts_.size());
    const int64_t record = static_cast<int64_t>(core::quantized_bytes(static_cast<size_t>(n), format));
    const int64_t host_records = max_local_size_ * record;
    at::Tensor records = at::empty({hosts * host_records}, at::kByte);  // every host's, in host order
    auto record_of = [&](int h, int64_t l) { return records.narrow(0, h * host_records + l * record, record); };
    for (size_t l = 0; l < hosts_[host_].size(); ++l) {
      core::quantize(host_block.narrow(0, static_cast<int64_t>(l) * n, n).data_ptr(), static_cast<size_t>(n), dtype,
                     format, record_of(host_, static_cast<int64_t>(l)).data_ptr());
    }
    std::vector<at::Tensor> to_peer, from_peer;
    for (int h = 0; h < hosts; ++h) {
      if (h == host_) continue;
      to_peer.push_back(records.narrow(0, host_ * host_records, host_records));
      from_peer.push_back(records.narrow(0, h * host_records, host_records));
    }
    c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
    wait_inner(op, "the inter-host all-gather (gloo among host leaders)", leaders,
               start_exchange(op, *leaders, to_peer, from_peer));
    at::Tensor flat = output.view({-1});
    for (int h = 0; h < hosts; ++h) {
      for (size_t l = 0; l < hosts_[h].size(); ++l) {
        core::dequantize(record_of(h, static_cast<int64_t>(l)).data_ptr(), static_cast<size_t>(n), dtype, format,
                         flat.narrow(0, hosts_[h][l] * n, n).data_ptr());
      }
    }
  } else if (leader()) {
    const int64_t hosts = static_cast<int64_t>(hosts_.size());
    at::Tensor all_hosts = at::empty({block * hosts}, input.options());
    if (n > 0) {
      at::Tensor out_bytes = as_bytes(all_hosts);
      at::Tensor in_bytes = as_bytes(host_block);
      c10d::AllgatherOptions options;
      options.timeout = op.timeout;
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host all-gather (gloo among host leaders)", leaders,
                 leaders->_allgather_base(out_bytes, in_bytes, options));
    }
    at::Tensor flat = output.view({-1});
    for (int64_t h = 0; h < hosts; ++h) {
      const std::vector<int>& ranks = hosts_[h];
      for (size_t l = 0; l < ranks.size(); ++l) {
        flat.narrow(0, ranks[l] * n, n).copy_(all_hosts.narrow(0, h * block + static_cast<int64_t>(l) * n, n));
      }
    }
  }
  local_->broadcast(output.data_ptr(), numel_of(output), dtype, 0, in_host(op));
}

void HierarchicalEngine::leaders_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                                core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = output.numel();
  const std::vector<int>& mine = hosts_[host_];
  const int64_t host_count = static_cast<int64_t>(mine.size()) * n;
  const int64_t block = static_cast<int64_t>(max_local_size_) * n;  // a host's blocks, padded to the largest host
  at::Tensor host_blocks;  // the leader's: this host's ranks' blocks summed over every host, in local order
  if (!leader()) {
    local_->reduce(input.data_ptr(), nullptr, numel_of(input), dtype, reduce, 0, in_host(op));
  } else {
    at::Tensor partial = at::empty_like(input);
    local_->reduce(input.data_ptr(), partial.data_ptr(), numel_of(input), dtype, reduce, 0, in_host(op));
    at::Tensor flat = partial.view({-1});
    // Each other host gets this host's partial sums of its ranks' blocks; theirs of this host's ranks come back.
    // (Zeros: a smaller host's padding must not weigh in a quantized block's scale.)
    at::Tensor send = at::zeros({(hosts - 1) * block}, input.options());
    at::Tensor received = at::empty({(hosts - 1) * block}, input.options());
    at::Tensor own = at::empty({host_count}, input.options());
    std::vector<const void*> sums;  // this host's blocks as each host summed them, in host order
    for (int h = 0, peer = 0; h < hosts; ++h) {
      at::Tensor to = h == host_ ? own : send.narrow(0, peer * block, block);
      for (size_t l = 0; l < hosts_[h].size(); ++l) {
        to.narrow(0, static_cast<int64_t>(l) * n, n).copy_(flat.narrow(0, hosts_[h][l] * n, n));
      }
      sums.push_back(h == host_ ? own.data_ptr() : received.narrow(0, (peer++) * block, host_count).data_ptr());
    }
    host_blocks = own;
    if (n > 0) {
      const Wire wire(reduce_wire(op, input, reduce), dtype);
      const std::vector<at::Tensor> to_host = send.chunk(hosts - 1), from_host = received.chunk(hosts - 1);
      std::vector<at::Tensor> to_peer, from_peer;
      for (int i = 0; i < hosts - 1; ++i) {
        to_peer.push_back(wire.outgoing(to_host[i]));
        from_peer.push_back(wire.landing(from_host[i]));
      }
      c10::intrusive_ptr<c10d::Backend> leaders = inter_host_for(op);
      wait_inner(op, "the inter-host reduce-scatter (gloo among host leaders)", leaders,
                 start_exchange(op, *leaders, to_peer, from_peer));
      for (int i = 0; i < hosts - 1; ++i) wire.arrived(from_peer[i], from_host[i]);
      host_blocks = at::empty({host_count}, input.options());
      core::reduce_into(host_blocks.data_ptr(), sums.data(), hosts, static_cast<size_t>(host_count), dtype, reduce);
    }
  }
  local_->scatter(leader() ? host_blocks.data_ptr() : nullptr, output.data_ptr(), static_cast<size_t>(n), dtype, 0,
                  in_host(op));
}

}  // namespace shardkit::comm

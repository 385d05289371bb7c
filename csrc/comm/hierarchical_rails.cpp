// The rails of HierarchicalEngine (hierarchical_engine.h has each op's steps): in a group of equal hosts of
// consecutive ranks, local rank k of every host exchanges with local rank k of the others, so that every rank moves
// 1/L of the host's bytes across at once; large allreduces, all-gathers and reduce-scatters run this way, in pieces of
// kRailPieceBytes, each piece's in-host steps overlapping the earlier pieces' time on the link.
//
// Promise: the bytes on the link are the leader scheme's, every rank ends with the same bits (each element is summed
// by one rank, in host order), and exchanges are waited for in the order they were posted (ExchangeWaiter).
// pipelined_allreduce also serves the leader scheme's quantized allreduce, on the leaders' rail without in-host
// steps.
#include "comm/hierarchical_engine.h"

#include <algorithm>
#include <vector>

#include "comm/hierarchical_internal.h"
#include "core/reduce.h"

namespace shardkit::comm {

using namespace hierarchical;

namespace {

// The inter-host ops one collective has in flight on its rail at once. Should the collective fail with one still
// running (its backend must then never be destroyed, inner_backends.h), the backend is abandoned.
struct InFlight {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;

  ~InFlight() {
    for (const auto& work : works) {
      if (work && !work->isCompleted()) {
        InnerBackends::abandon(std::move(backend));
        return;
      }
    }
  }
};

// `total` elements in pieces of kRailPieceBytes, the last one shorter: the unit of the rails' pipelines.
struct Pieces {
  Pieces(int64_t total, int64_t element_size)
      : total(total),
        length(std::max<int64_t>(1, static_cast<int64_t>(HierarchicalEngine::kRailPieceBytes) / element_size)),
        count((total + length - 1) / length) {}

  int64_t size(int64_t q) const { return std::min(length, total - q * length); }
  // Piece q of a run of `total` elements.
  at::Tensor of(const at::Tensor& run, int64_t q) const { return run.narrow(0, q * length, size(q)); }

  int64_t total, length, count;
};

}  // namespace

at::Tensor HierarchicalEngine::host_run(const at::Tensor& flat, int host, int64_t block) const {
  return flat.narrow(0, hosts_[host].front() * block, static_cast<int64_t>(max_local_size_) * block);
}

void HierarchicalEngine::pipelined_allreduce(const OpContext& op, at::Tensor& data, core::ReduceOp reduce,
                                             bool in_host_steps) {
  const core::DType dtype = core_dtype(data);
  const Wire wire(reduce_wire(op, data, reduce), dtype);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t ranks_here = in_host_steps ? max_local_size_ : 1;
  const int64_t position = in_host_steps ? local_rank_ : 0;  // this rank's slice of each piece
  const int64_t count = data.numel();
  const int64_t slice = (count + ranks_here - 1) / ranks_here;  // each rank's share of the whole
  // The in-host steps need `ranks_here` equal slices: a count they do not divide works in a padded copy.
  const bool padded = count % ranks_here != 0;
  at::Tensor work = padded ? at::empty({slice * ranks_here}, data.options()) : data.view({-1});
  if (padded) work.narrow(0, 0, count).copy_(data.view({-1}));
  const Pieces slices(slice, data.element_size());  // each rank's slice of every piece
  const int64_t pieces = slices.count;
  auto slice_of = [&](int64_t p) { return slices.size(p); };
  auto piece_of = [&](int64_t p) { return work.narrow(0, p * slices.length * ranks_here, slice_of(p) * ranks_here); };
  auto mine_of = [&](int64_t p) { return piece_of(p).narrow(0, position * slice_of(p), slice_of(p)); };
  // A slice's part j is summed by the rail's rank j (host j), which then sends the sum to the others.
  auto part_of = [&](int64_t p, int j) {
    const int64_t m = slice_of(p);
    return mine_of(p).narrow(0, m * j / hosts, m * (j + 1) / hosts - m * j / hosts);
  };
  std::vector<int> peers;  // the rail's other ranks (hosts), in order
  for (int h = 0; h < hosts; ++h) {
    if (h != host_) peers.push_back(h);
  }
  InFlight rail{nullptr, std::vector<c10::intrusive_ptr<c10d::Work>>(2 * pieces)};
  std::vector<at::Tensor> received(pieces);  // piece p: the other hosts' partial sums of this host's part
  std::vector<std::vector<at::Tensor>> landings(2 * pieces);  // where each exchange's incoming bytes land
  // The three stages of a piece. Tags keep each exchange apart from the others in flight on the same pairs.
  auto scatter_piece = [&](int64_t p) {  // in the host: this rank's slice summed; across: parts to their owners
    if (in_host_steps) {
      at::Tensor piece = piece_of(p);
      local_->reduce_scatter(piece.data_ptr(), mine_of(p).data_ptr(), static_cast<size_t>(slice_of(p)), dtype, reduce,
                             in_host(op));
    }
    if (p == 0) rail.backend = inter_host_for(op);  // (a leader: after the fingerprint, which ran meanwhile)
    const int64_t own = part_of(p, host_).numel();
    received[p] = at::empty({(hosts - 1) * own}, data.options());
    std::vector<at::Tensor> to_peer;
    for (int h : peers) to_peer.push_back(wire.outgoing(part_of(p, h)));
    for (int i = 0; i < hosts - 1; ++i) landings[2 * p].push_back(wire.landing(received[p].narrow(0, i * own, own)));
    rail.works[2 * p] = start_exchange(op, *rail.backend, to_peer, landings[2 * p], static_cast<int>(2 * p));
  };
  auto reduce_piece = [&](int64_t p) {  // this host's part summed over the hosts, in host order; sent to all
    wait_inner(op, "the inter-host reduce-scatter step of an allreduce (gloo on the rails)", rail.backend,
               rail.works[2 * p]);
    at::Tensor own = part_of(p, host_);
    std::vector<const void*> sums;
    for (int h = 0, i = 0; h < hosts; ++h) {
      if (h == host_) {
        sums.push_back(own.data_ptr());
        continue;
      }
      at::Tensor theirs = received[p].narrow(0, i * own.numel(), own.numel());
      wire.arrived(landings[2 * p][i++], theirs);
      sums.push_back(theirs.data_ptr());
    }
    core::reduce_into(own.data_ptr(), sums.data(), hosts, static_cast<size_t>(own.numel()), dtype, reduce);
    received[p] = at::Tensor();
    landings[2 * p].clear();
    std::vector<at::Tensor> to_peer(hosts - 1, wire.outgoing(own, /*hold_what_is_sent=*/true));
    for (int h : peers) landings[2 * p + 1].push_back(wire.landing(part_of(p, h)));
    rail.works[2 * p + 1] = start_exchange(op, *rail.backend, to_peer, landings[2 * p + 1], static_cast<int>(2 * p + 1));
  };
  auto gather_piece = [&](int64_t p) {  // the hosts' sums in, then shared in the host
    wait_inner(op, "the inter-host all-gather step of an allreduce (gloo on the rails)", rail.backend,
               rail.works[2 * p + 1]);
    for (size_t i = 0; i < peers.size(); ++i) wire.arrived(landings[2 * p + 1][i], part_of(p, peers[i]));
    landings[2 * p + 1].clear();
    if (in_host_steps) {
      at::Tensor piece = piece_of(p);
      local_->allgather(mine_of(p).data_ptr(), piece.data_ptr(), static_cast<size_t>(slice_of(p)), dtype,
                        in_host(op));
    }
  };
  // Pipelined: a piece's in-host steps run while the pieces before it are on the link.
  for (int64_t p = 0; p < pieces + 2; ++p) {
    if (p < pieces) scatter_piece(p);
    if (p >= 1 && p - 1 < pieces) reduce_piece(p - 1);
    if (p >= 2) gather_piece(p - 2);
  }
  if (padded) data.view({-1}).copy_(work.narrow(0, 0, count));
}

void HierarchicalEngine::rails_allgather(const OpContext& op, const at::Tensor& input, at::Tensor& output) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = input.numel();
  at::Tensor flat = output.view({-1});
  const Wire wire(gather_wire(op, input), dtype);
  // What this host shares of this rank's input: the input, or (quantized) what the other hosts decode of it, so
  // that every rank holds the same bits.
  at::Tensor in = wire.exact() ? input.reshape({-1}) : input.reshape({-1}).clone();
  const Pieces pieces(n, input.element_size());
  // Each other host's block at this rank's position arrives straight into its place in `output`; the in-host
  // all-gather of that host's blocks then leaves it where it is (in place).
  std::vector<at::Tensor> from_host;
  for (int h = 0; h < hosts; ++h) {
    if (h != host_) from_host.push_back(host_run(flat, h, n).narrow(0, local_rank_ * n, n));
  }
  // Every piece's exchange is posted at once (the link takes them in order); this host's in-host all-gather runs
  // meanwhile, then each other host's pieces are shared in the host as they arrive.
  InFlight rail{inter_host_for(op), {}};
  std::vector<std::vector<at::Tensor>> landings(pieces.count);
  for (int64_t q = 0; q < pieces.count; ++q) {
    std::vector<at::Tensor> to_peer(hosts - 1, wire.outgoing(pieces.of(in, q), /*hold_what_is_sent=*/true));
    for (const at::Tensor& block : from_host) landings[q].push_back(wire.landing(pieces.of(block, q)));
    rail.works.push_back(start_exchange(op, *rail.backend, to_peer, landings[q], static_cast<int>(q)));
  }
  local_->allgather(in.data_ptr(), host_run(flat, host_, n).data_ptr(), static_cast<size_t>(n), dtype, in_host(op));
  for (int64_t q = 0; q < pieces.count; ++q) {
    wait_inner(op, "the inter-host all-gather (gloo on the rails)", rail.backend, rail.works[q]);
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h == host_) continue;
      wire.arrived(landings[q][peer], pieces.of(from_host[peer], q));
      local_->allgather_strided(pieces.of(from_host[peer++], q).data_ptr(), pieces.of(host_run(flat, h, n), q).data_ptr(),
                                static_cast<size_t>(pieces.size(q)), static_cast<size_t>(n), dtype, in_host(op));
    }
  }
}

void HierarchicalEngine::rails_reduce_scatter(const OpContext& op, const at::Tensor& input, at::Tensor& output,
                                              core::ReduceOp reduce) {
  const core::DType dtype = core_dtype(input);
  const int hosts = static_cast<int>(hosts_.size());
  const int64_t n = output.numel();
  at::Tensor flat = input.reshape({-1});
  at::Tensor out = output.view({-1});  // first this host's partial sum of this rank's block, then the whole sum
  const Wire wire(reduce_wire(op, input, reduce), dtype);
  const Pieces pieces(n, input.element_size());
  std::vector<std::vector<at::Tensor>> landings(pieces.count);  // where each piece's incoming bytes land
  // to_host[i]: this host's partial sums of local rank k's block of the i-th other host; from_host[i]: that host's
  // of this rank's block.
  at::Tensor send = at::empty({(hosts - 1) * n}, input.options());
  at::Tensor received = at::empty({(hosts - 1) * n}, input.options());
  std::vector<at::Tensor> to_host = send.chunk(hosts - 1), from_host = received.chunk(hosts - 1);
  InFlight rail{nullptr, std::vector<c10::intrusive_ptr<c10d::Work>>(pieces.count)};
  // Piece q of every block: summed in the host (the other hosts' first, so they go on the link at once), exchanged,
  // then summed over the hosts in host order once it is in, while later pieces are summed in the host. Piece q of
  // `output` is written only once the in-host step has read piece q of every input block (`output` may be this
  // rank's own block of `input`).
  auto scatter_piece = [&](int64_t q) {
    const size_t count = static_cast<size_t>(pieces.size(q));
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h == host_) continue;
      local_->reduce_scatter_strided(pieces.of(host_run(flat, h, n), q).data_ptr(), static_cast<size_t>(n),
                                     pieces.of(to_host[peer++], q).data_ptr(), count, dtype, reduce, in_host(op));
    }
    if (q == 0) rail.backend = inter_host_for(op);  // (a leader: after the fingerprint, which ran meanwhile)
    std::vector<at::Tensor> to_peer;
    for (int i = 0; i < hosts - 1; ++i) {
      to_peer.push_back(wire.outgoing(pieces.of(to_host[i], q)));
      landings[q].push_back(wire.landing(pieces.of(from_host[i], q)));
    }
    rail.works[q] = start_exchange(op, *rail.backend, to_peer, landings[q], static_cast<int>(q));
    local_->reduce_scatter_strided(pieces.of(host_run(flat, host_, n), q).data_ptr(), static_cast<size_t>(n),
                                   pieces.of(out, q).data_ptr(), count, dtype, reduce, in_host(op));
  };
  auto sum_piece = [&](int64_t q) {
    wait_inner(op, "the inter-host reduce-scatter (gloo on the rails)", rail.backend, rail.works[q]);
    std::vector<const void*> sums;
    for (int h = 0, peer = 0; h < hosts; ++h) {
      if (h != host_) wire.arrived(landings[q][peer], pieces.of(from_host[peer], q));
      sums.push_back(pieces.of(h == host_ ? out : from_host[peer++], q).data_ptr());
    }
    landings[q].clear();
    core::reduce_into(pieces.of(out, q).data_ptr(), sums.data(), hosts, static_cast<size_t>(pieces.size(q)), dtype,
                      reduce);
  };
  for (int64_t q = 0; q <= pieces.count; ++q) {
    if (q < pieces.count) scatter_piece(q);
    if (q >= 1) sum_piece(q - 1);
  }
}

}  // namespace shardkit::comm

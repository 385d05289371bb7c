// LocalPointToPoint: send/recv between two ranks of one host, the bytes read by the receiver straight out of the
// sender's memory (process_vm_readv: one copy, no socket) instead of streamed through the inner gloo backend.
//
// Which messages: a dense contiguous CPU tensor of at least `direct_bytes`, between two ranks of this group on one
// host whose pids the start-up exchanged (same pid namespace). Smaller messages, peers on other hosts and the rest
// go to gloo as before. Both ends decide alike from the same facts (the size, the host grouping, the pids), so a
// pair's messages never disagree on the route as long as both ranks run with the same SHARDKIT_P2P_DIRECT_BYTES.
//
// Protocol, per message (sequence s, numbered per destination by the sender):
//   sender   send():  copies the tensor into a staging buffer, so that its Work completes as gloo's does, without
//                     waiting for the receiver (a receiver may wait on its own send first: pipeline stages do);
//                     sends a descriptor {magic, sender's group rank, pid, address, bytes, s} over gloo with the
//                     caller's tag (so the order among a pair's messages is gloo's, small and large alike); posts
//                     the receive of the receipt on control tag receipt_tag(s). The reaper thread waits for the
//                     receipts in order and takes the staging buffers back.
//   receiver wait():  receives the descriptor; refuses a size other than its own (the receipt says so, the error
//                     names both sizes); reads the bytes with process_vm_readv when the descriptor's pid is the one
//                     the start-up exchanged for that rank; sends the receipt {status, s}. Where the kernel refuses
//                     the read (ptrace policy, seccomp) or SHARDKIT_P2P_DIRECT_READ=0, the receipt asks for the
//                     bytes and the reaper sends them over gloo on bytes_tag(s).
// Control tags are kControlTags and above; a caller's tag must be below, on either route (check_tag).
//
// Waits: every gloo step has the group's timeout; abort() (the group's abort_with, through the tracked Works) ends a
// receiver's step and the reaper's current wait. A receiver's Work completes only in wait(), as gloo's receives do.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/inner_backends.h"
#include "core/liveness.h"

namespace shardkit::comm {

// The point-to-point Works of a group still in flight (gloo's, and the direct route's steps), remembered weakly so
// that the group's abort can end them while they wait. Shared: a direct receive may outlive the group object.
class TrackedWorks {
 public:
  void add(const c10::intrusive_ptr<c10d::Work>& work);
  // Those not completed, forgotten here: for the caller to abort (gloo's abort wakes a blocked wait, which then
  // returns false).
  std::vector<c10::intrusive_ptr<c10d::Work>> take_waiting();

 private:
  std::mutex mutex_;
  std::vector<c10::weak_intrusive_ptr<c10d::Work>> works_;  // pruned as it grows
};

class LocalPointToPoint : public std::enable_shared_from_this<LocalPointToPoint> {
 public:
  static constexpr int kControlTags = 1 << 30;

  struct Options {
    int rank = 0;                  // this rank's place in the group
    core::PeerNames names;         // how messages name the group's ranks, and their pids (0 / unwatched: unknown)
    std::vector<bool> on_this_host;  // on_this_host[r]: group rank r shares this host
    size_t direct_bytes = size_t{256} << 10;  // smallest message read directly
    bool direct_read = true;       // false: the receipt always asks for the bytes over gloo (SHARDKIT_P2P_DIRECT_READ=0)
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  };

  // `tracked`: where every gloo Work this route starts is recorded, so that the group's abort ends it.
  LocalPointToPoint(Options options, std::shared_ptr<InnerBackends> inner, std::shared_ptr<TrackedWorks> tracked);
  ~LocalPointToPoint();

  // Refuses a caller's tag in the control range, naming it: for every send and receive of the group, whichever its
  // route (a small message with such a tag could meet a receipt between the same two ranks).
  static void check_tag(int tag, const std::string& where);
  // Whether a message of `tensor` to or from `peer` takes this route.
  bool direct(const at::Tensor& tensor, int peer) const;
  // For a receive from any source: true (this route) where every other rank of the group is on this host with a
  // known pid, false (gloo) where none is; throws, naming the case, where some are and some are not (a sender's
  // route would depend on where it runs, which the receiver cannot know beforehand).
  bool direct_from_any(const at::Tensor& tensor, const std::string& where) const;

  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag, const std::string& where);
  // src < 0: from any source (direct_from_any said yes).
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag, const std::string& where);

  // Payload bytes this rank has received by reading a peer's memory directly.
  uint64_t direct_bytes_received() const { return direct_received_.load(); }
  // destroy_process_group() (and the exit hook): first waits, up to the group's timeout, for the receipts still
  // awaited: a receiver reads the staged bytes after this rank's send has completed, possibly after it went on to
  // end the group, and this process must outlive that read. Then aborts what is left (staging buffers dropped)
  // and joins the reapers. `drain` false: no wait (the destructor).
  void shutdown(bool drain = true);

  // Called by a receiver's Work (DirectRecvWork, local_p2p.cpp).
  const Options& options() const { return options_; }
  c10::intrusive_ptr<c10d::Backend> gloo(const std::string& where) { return inner_->all_ranks(where); }
  void track(const c10::intrusive_ptr<c10d::Work>& work) { tracked_->add(work); }
  bool read_allowed() const { return read_allowed_.load(); }
  // The kernel refused a read: every later message asks for its bytes over gloo (logged once).
  void refuse_reads(const std::string& why);
  void count_received(uint64_t bytes) { direct_received_ += bytes; }

  static int receipt_tag(int64_t seq) { return kControlTags + 2 * static_cast<int>(seq % (1 << 28)); }
  static int bytes_tag(int64_t seq) { return receipt_tag(seq) + 1; }

 private:
  struct Pending {
    int64_t seq = 0;
    at::Tensor staged;
    at::Tensor receipt;
    c10::intrusive_ptr<c10d::Work> receipt_recv;
    c10::intrusive_ptr<c10d::Backend> gloo;
  };
  // One destination's receipts, awaited in send order by its own thread: a receiver that waits for its messages
  // in another order than another destination's never holds this one up.
  struct Reaper {
    std::deque<Pending> pending;
    c10::intrusive_ptr<c10d::Work> awaited;  // the receipt its thread waits for now
    std::thread thread;                      // started at the first direct send to the destination
  };
  void reap(int dst);
  at::Tensor take_staging(size_t bytes);

  Options options_;
  std::shared_ptr<InnerBackends> inner_;
  std::shared_ptr<TrackedWorks> tracked_;
  std::atomic<bool> read_allowed_;
  std::atomic<uint64_t> direct_received_{0};

  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_reapers_;
  std::condition_variable reaped_;  // a receipt came back (or was given up on)
  std::vector<int64_t> next_seq_;  // per destination
  std::vector<Reaper> reapers_;    // per destination
  std::vector<at::Tensor> staging_pool_;  // staging buffers whose receipts came back, for reuse
  bool stopping_ = false;
};

}  // namespace shardkit::comm

// LocalPointToPoint: send/recv between two ranks of one host, the bytes read by the receiver out of the sender's
// memory (process_vm_readv) instead of streamed through the inner gloo backend's sockets.
//
// Which messages: a dense contiguous CPU tensor of at least `direct_bytes`, between two ranks of this group on one
// host whose pids the start-up exchanged (same pid namespace). Smaller messages, peers on other hosts and the rest
// go to gloo as before. Both ends decide alike from the same facts (the size, the host grouping, the pids; the
// start-up checks that every rank has the same `direct_bytes`), so a pair never disagrees on a message's route.
//
// Protocol, per message (sequence s, numbered per destination by the sender):
//   sender:   copies the tensor into a staging buffer (so that its Work completes as gloo's does, once the message
//             is handed over, not once the receiver has read it: pipeline stages wait for their sends first), and
//             sends a descriptor {magic, sender's group rank, pid, address, bytes, s} over gloo with the caller's
//             tag: the order among a pair's messages is gloo's, small and large alike. Its Work completes when the
//             descriptor is delivered. It then waits for the receipt on control tag receipt_tag(s) and takes the
//             staging buffer back.
//   receiver: receives the descriptor; refuses a size other than its own (the receipt says so; the error names
//             both sizes); reads the bytes with process_vm_readv where the descriptor's pid is the one the start-up
//             exchanged for that rank; sends the receipt {status, s}. Where the kernel refuses the read (a ptrace
//             policy, seccomp: logged once) or SHARDKIT_P2P_DIRECT_READ=0, the receipt asks for the bytes, which
//             follow over gloo on bytes_tag(s). Any failure after the descriptor still sends a receipt.
// Each message runs on a thread of its own from the moment it is posted, as gloo moves bytes whether or not anyone
// waits: no message waits behind another (receives waited for in any order, to any peer, with any tags), and a
// receive nobody waits for still completes. A Work waits for its message's thread.
//
// Failure: every gloo step has the group's timeout. The group's abort (abort_with, through TrackedWorks) ends the
// step a message waits in; its Work then fails naming the op. A staging buffer whose receipt never came back is
// never freed (a receiver may still read it): it is kept for the life of the process, as inner_backends.h keeps a
// gloo backend an op was given up on. destroy_process_group() first lets the messages in flight finish (up to the
// timeout): a receiver reads the staged bytes after the sender's send completed, perhaps after it went on to end
// its group, and the sender's process must outlive that read.
// Control tags are kControlTags and above; a caller's tag must be below, on either route (check_tag).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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
// that the group's abort can end them while they wait. Shared with the direct route's message threads.
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

class LocalPointToPoint {
 public:
  static constexpr int kControlTags = 1 << 30;

  struct Options {
    int rank = 0;                    // this rank's place in the group
    core::PeerNames names;           // how messages name the group's ranks, and their pids (0 / unwatched: unknown)
    std::vector<bool> on_this_host;  // on_this_host[r]: group rank r shares this host
    size_t direct_bytes = size_t{2} << 20;  // smallest message on this route
    bool direct_read = true;  // false: the receipt always asks for the bytes over gloo (SHARDKIT_P2P_DIRECT_READ=0)
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  };
  // What the message threads share (local_p2p.cpp); never the object that owns the threads.
  struct Shared;
  // One message's progress (local_p2p.cpp).
  struct Transfer;

  // `tracked`: where every gloo Work of this route is recorded, so that the group's abort ends it.
  LocalPointToPoint(Options options, std::shared_ptr<InnerBackends> inner, std::shared_ptr<TrackedWorks> tracked);
  // shutdown(false).
  ~LocalPointToPoint();
  LocalPointToPoint(const LocalPointToPoint&) = delete;
  LocalPointToPoint& operator=(const LocalPointToPoint&) = delete;

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

  // Payload bytes this rank has received by reading a peer's memory.
  uint64_t direct_bytes_received() const;
  // The group's abort: every message in flight fails (the step it waits in is ended), now and at its next step.
  void abort();
  // destroy_process_group() (and the exit hook): with `drain`, first waits up to the group's timeout for the
  // messages in flight (see above); then aborts what is left and joins the message threads. Idempotent.
  void shutdown(bool drain = true);

 private:
  // Starts `body` on a thread of its own for `transfer`, joining the threads of messages that have ended.
  void start(const std::shared_ptr<Transfer>& transfer, std::function<void()> body);

  std::shared_ptr<Shared> shared_;
  std::mutex mutex_;  // guards below
  std::vector<int64_t> next_seq_;  // per destination
  std::vector<std::pair<std::shared_ptr<Transfer>, std::thread>> threads_;
  bool stopped_ = false;
};

}  // namespace shardkit::comm

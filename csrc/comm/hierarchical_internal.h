// What the files of HierarchicalEngine share and no one else includes: hierarchical_engine.h is the engine's
// interface and its protocols; this header holds the private helpers its files have in common.
//
//   hierarchical_engine.cpp       the host layout, the engine's construction and shutdown, each op's choice of
//                                 scheme (leaders or rails: use_rails)
//   hierarchical_leaders.cpp      the leader scheme: one rank per host talks (barrier, broadcast, reduce, and the
//                                 small or rail-less allreduce, all-gather, reduce-scatter)
//   hierarchical_rails.cpp        the rails: local rank k talks to local rank k of the other hosts (the pipelined
//                                 allreduce, all-gather and reduce-scatter of large ops)
//   hierarchical_fallback.cpp     gather, scatter, all-to-all: gloo over all ranks, as raw bytes
//   hierarchical_exchange.cpp     point-to-point exchanges between hosts and the engine's thread that waits for them
//   hierarchical_wire.cpp         the quantized wire: which ops' inter-host bytes are records, and their coding
//   hierarchical_fingerprint.cpp  the leaders' agreement check before an op's inter-host steps
//   hierarchical_failure.cpp      the failure protocol: guarded ops, waits on gloo with deadlines, aborts
//
// Promise: helpers here only compute or wrap (names, byte views, the wire's coding, the op guard); none starts
// an inter-host step of its own.
#pragma once

#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/hierarchical_engine.h"

namespace shardkit::comm {

namespace hierarchical {

// The in-host steps of a collective wait this much longer than its inter-host steps: a local rank that is late
// because its own inter-host step waits on a slow or cut link then times out there first, and its error, which names
// the host it cannot reach, is the group's root cause (not "rank 0 did not arrive" from a peer on its own host). A
// local rank that dies is seen at once (its pid) either way.
constexpr auto kInHostGrace = std::chrono::milliseconds(5000);

// One step of `op` inside the host: it waits for what is left of the op's timeout, plus the grace.
inline core::CallInfo in_host(const OpContext& op) {
  core::CallInfo call = op.call(true);
  if (call.timeout.count() > 0) call.timeout = op.left() + kInHostGrace;
  return call;
}

// A failed step of an inner gloo backend (as opposed to one of the host's own shm group).
struct InnerStepError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The wire formats of an op's data between hosts (OpContext::quantization): only floating data, and for reductions only
// sums, are quantized.
core::QuantFormat gather_wire(const OpContext& op, const at::Tensor& data);
core::QuantFormat reduce_wire(const OpContext& op, const at::Tensor& data, core::ReduceOp reduce);

// How one op's runs of values travel between hosts: as they are, or as records of `format` (core/quantize.h).
class Wire {
 public:
  Wire(core::QuantFormat format, core::DType dtype) : format_(format), dtype_(dtype) {}

  bool exact() const { return format_.exact(); }
  // What goes on the link for `values`: the values themselves, or their record. With `hold_what_is_sent`, `values`
  // become what the receivers will decode, so that sender and receivers hold the same bits.
  at::Tensor outgoing(const at::Tensor& values, bool hold_what_is_sent = false) const;
  // Where the link leaves what arrives for `values`: `values` themselves, or a record for arrived() to decode.
  at::Tensor landing(const at::Tensor& values) const;
  void arrived(const at::Tensor& landing, const at::Tensor& values) const;

 private:
  core::QuantFormat format_;
  core::DType dtype_;
};

}  // namespace hierarchical

// The waits of the engine's point-to-point exchanges (start_exchange), on one thread the engine owns.
//
// Why a thread: a gloo send or receive can only be waited for whole (a wait that times out ends it as failed, and
// its isCompleted() changes only inside a wait), so wait_inner cannot look at one in slices as it does at gloo's
// collectives. This thread waits for each exchange's sends and receives until the op's deadline and records the
// outcome; the Work post() returns only looks at that record, so wait_inner's slices treat it like a collective.
//
// Protocol (mutex_ guards queue_, current_ and stopping_):
//   - post() (the group's worker thread) appends the exchange to queue_ and notifies; after stop() it refuses: the
//     Work it returns has failed already ("the engine was shut down").
//   - The thread takes the oldest exchange into current_, waits for its Works one after the other outside the lock,
//     each until the exchange's deadline, then records the first failure (naming the peer) or success, wakes its
//     waiters, and takes the next. It waits in posting order, which is also the order in which every collective
//     waits for its exchanges (hierarchical_rails.cpp), so an exchange is never reported later than its caller
//     would look at it. With nothing queued it sleeps on the condition variable, and it leaves once stopping_ is
//     set and the queue is empty.
//   - An exchange the engine gave up on (an abort, the group's notice, a deadline: wait_inner) stays with the thread
//     until its Works end or reach the deadline, keeping them and their tensors alive meanwhile.
//   - stop() (shutdown(), the destructor) sets stopping_ and aborts the Works of current_ and of every queued
//     exchange (c10d::Work::abort: for gloo's send and receive it wakes the wait blocked on it, or makes the next
//     one return at once), then joins. So the thread ends even while an exchange waits on a dead peer with an hour
//     of timeout left; what it had not finished reports "the engine was shut down".
class ExchangeWaiter {
 public:
  ExchangeWaiter();
  ~ExchangeWaiter() { stop(); }
  ExchangeWaiter(const ExchangeWaiter&) = delete;
  ExchangeWaiter& operator=(const ExchangeWaiter&) = delete;

  // The exchange made of `works` (peer_of[i]: who works[i] talks to, for messages), waited for until `timeout` from
  // now. The Work returned ends when all of them have, failed with the first failure.
  c10::intrusive_ptr<c10d::Work> post(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                                      std::vector<std::string> peer_of, std::chrono::milliseconds timeout);
  // Idempotent; see the protocol above.
  void stop();

  // What a posted exchange's Work and the thread share.
  struct Outcome {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
    std::exception_ptr error;

    void finish(std::exception_ptr failure);
  };

 private:
  struct Exchange {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<std::string> peer_of;
    std::chrono::steady_clock::time_point deadline;
    std::shared_ptr<Outcome> outcome;
  };

  void run();
  static void abort_works(const Exchange& exchange);

  std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<Exchange> queue_;
  std::optional<Exchange> current_;  // the exchange being waited for
  bool stopping_ = false;
  std::thread thread_;  // last: started once the rest is ready
};

template <typename Steps>
void HierarchicalEngine::guarded(const OpContext& op, std::optional<LeaderStep> step, Steps steps) {
  if (const std::string reason = aborted_reason(); !reason.empty()) {
    throw std::runtime_error(op.where() + "group was aborted earlier: " + reason);
  }
  try {
    if (step && leader() && op.compare_across_hosts) start_fingerprint(op, *step);
    steps();
    settle_fingerprint(op);  // an op whose leaders moved no bytes between hosts (empty tensors) still agrees
  } catch (const hierarchical::InnerStepError& error) {
    abandon_fingerprint();
    abort_everywhere(op, error.what(), /*await_root_cause=*/true);
  } catch (const std::exception& error) {
    abandon_fingerprint();
    abort_everywhere(op, message_of(error), /*await_root_cause=*/false);
  }
}

}  // namespace shardkit::comm

// CollectiveSequencer: issues collectives in ticket order, whichever thread asks and whenever, without
// ever making a thread wait for its turn. Torch-free (the torch glue is csrc/compress/futures.h).
//
// Why: gloo and NCCL match collectives by the order in which each rank issues them on a process group,
// not by name (docs/design.md, "Collective order"). A comm hook that chains collectives through future
// callbacks — PowerSGD issues P, and Q only once P is back — issues the later ones on whichever thread
// completes the earlier ones, at a moment that differs from rank to rank, while the autograd thread goes
// on issuing the next bucket's. Unordered, rank 0 can send bucket 3's Q while rank 1 sends bucket 4's
// first allreduce: gloo fails ("Received data size doesn't match expected size"), or, were the sizes
// equal, the ranks would silently sum unrelated tensors.
//
// Protocol:
//  1. Reserve. The code that knows the order — a comm hook, called on the autograd thread bucket after
//     bucket, the same order on every rank — takes consecutive tickets, one per collective it will
//     issue, before it issues any. Between reserving and submitting nothing may throw: a ticket that is
//     never submitted (and no failure reported) holds every later ticket back.
//  2. Submit. When a collective is ready (its inputs computed: at once, or in the callback of the
//     collective before it), its step — a function that issues it and chains what follows — is handed
//     in with its ticket. A step whose ticket is next runs now, on the submitting thread; any other is
//     stored. A step's collective need not have completed for the next ticket's step to run: the order
//     that counts is the issue order.
//  3. Drain. The thread that runs a step then runs, one after another, the stored steps whose tickets
//     follow, until it meets a ticket not submitted yet: that step will run on the thread that submits
//     it. One thread drains at a time. A step submitted meanwhile — by another thread, or by the drainer
//     itself when issuing a collective completes it inline and its callback submits the next step
//     (shardkit's backend runs a collective issued from a callback inline on its worker) — is only
//     stored, and the drain loop picks it up: no recursion, and the mutex is never held while a step
//     runs.
// So a step may run on another thread than the one that submitted it, or on the same thread once the code
// that submitted it has returned: whatever of the submitter's context the step needs (for a CUDA collective,
// the streams that produced its input) it must carry itself — then_run_in_turn in csrc/compress/futures.h
// captures the submitter's current streams for it.
// No thread ever blocks for a turn. It must not: the autograd thread has the next buckets to launch,
// and a callback thread that waited might be the very thread that has to complete the collective it
// waits behind (shardkit's worker, gloo's completion threads).
//
// Failure is final. A collective that fails, or one that is reserved but never issued (its step threw
// before submitting it), breaks the order: skipping its ticket would pair this rank's next collective
// with a peer's previous one. So fail() (called by the glue when a collective or a step fails, and here
// when a step throws) records the first error; every stored step, and every step submitted afterwards,
// is abandoned — its `abandon` gets that error instead of its `run` being called — so nothing waits for
// a ticket that will never come. The owner (a PowerSGDState) must be rebuilt to communicate again.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>

namespace shardkit::core {

class CollectiveSequencer {
 public:
  using Run = std::function<void()>;
  using Abandon = std::function<void(std::exception_ptr)>;

  // Reserves `count` consecutive tickets (count >= 1) and returns the first.
  uint64_t reserve(uint64_t count);

  // Runs `run` in `ticket`'s turn: now, or later on the thread that runs the ticket before it. Once the
  // sequencer has failed, calls `abandon(first error)` instead (now or later). Exactly one of the two is
  // called, never under the mutex; `abandon` must not throw. If `run` throws, the sequencer fails with that
  // exception and this step's `abandon` receives it. A ticket that was not reserved, or was submitted
  // before, is a std::logic_error (thrown to the caller; the sequencer is unchanged).
  void submit(uint64_t ticket, Run run, Abandon abandon);

  // Records `error` unless an earlier one is recorded, and abandons every stored step on this thread.
  void fail(std::exception_ptr error);

  bool failed() const;
  // The next ticket to run, and one past the last reserved (next == reserved: nothing outstanding).
  uint64_t next() const;
  uint64_t reserved() const;

 private:
  struct Step {
    Run run;
    Abandon abandon;
  };
  // Runs stored steps while the next ticket's step is there; called with `lock` held, by the one drainer.
  void drain(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mutex_;
  uint64_t next_ = 0;      // the ticket whose step runs next
  uint64_t reserved_ = 0;  // tickets [0, reserved_) have been handed out
  std::map<uint64_t, Step> stored_;
  bool draining_ = false;  // a thread is inside drain(): submitters only store
  std::exception_ptr error_;
};

}  // namespace shardkit::core

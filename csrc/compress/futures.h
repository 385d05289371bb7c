// Future plumbing shared by the compression hooks: every hook returns a Future<Tensor> at once and does
// the rest of its work in callbacks, on whichever thread completes the collective it waits for (the
// backend's worker), so the autograd thread never blocks on a wait. A hook that issues a collective from
// a callback issues it through a CollectiveSequencer (then_run_in_turn), so that every rank issues its
// collectives in the same order (csrc/core/collective_sequencer.h explains why and how).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/collective_sequencer.h"

namespace shardkit::compress {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// The Future a hook returns: it will hold `like`'s result tensor (devices from `like`, for CUDA streams).
inline FuturePtr tensor_future(const at::Tensor& like) {
  std::vector<c10::Device> devices;
  if (!like.device().is_cpu()) devices.push_back(like.device());
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), std::move(devices));
}

// Sum-allreduce `tensor` in place over `group`; the Future completes when it is done.
inline FuturePtr allreduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor) {
  std::vector<at::Tensor> payload{tensor};
  return group->allreduce(payload)->getFuture();
}

// When `done` completes, runs `step()` on the completing thread. An error of `done`, or one `step` throws,
// completes `result` with that error, so a failed collective reaches the reducer instead of hanging it.
template <typename Step>
void then_run(const FuturePtr& done, const FuturePtr& result, Step step) {
  done->addCallback([result, step = std::move(step)](c10::ivalue::Future& finished) mutable {
    if (finished.hasError()) {
      result->setErrorIfNeeded(finished.exception_ptr());
      return;
    }
    try {
      step();
    } catch (...) {
      result->setErrorIfNeeded(std::current_exception());
    }
  });
}

// An exception's message (a c10::Error's without its C++ backtrace).
inline std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// then_run, with the collective issued in `ticket`'s turn of `sequencer` (a ticket the hook reserved, on
// the autograd thread, before issuing anything): `issue()` starts the collective and returns its Future;
// when it completes, `step()` runs on the completing thread (and may submit the next ticket). Nothing here
// waits for a turn. Any error — `issue`'s, the collective's, `step`'s — completes `result` with it and
// fails the sequencer, because a collective that failed or never went out breaks the order for every
// later ticket. A step abandoned for an earlier failure completes `result` with an error that names it
// (`what`: "shardkit PowerSGD (rank 0): bucket 4's Q allreduce"), its owner, and the first error.
// Streams: `issue()` may run on another thread than the one calling this (the sequencer's drainer), or on this
// thread after the caller has returned, where the current streams know nothing of the kernels that produced
// the collective's input. So the caller's current stream of each of `result`'s devices is taken now and made
// current around `issue()`: a CUDA collective orders itself after what its caller queued, whichever thread
// issues it. (Seen on a GPU before this: the drainer issued PowerSGD's Q allreduce on the stream of an
// earlier callback, before Q was computed.)
template <typename Issue, typename Step>
void then_run_in_turn(const std::shared_ptr<core::CollectiveSequencer>& sequencer, uint64_t ticket,
                      const FuturePtr& result, std::string what, const char* owner, Issue issue, Step step) {
  std::vector<c10::Stream> callers_streams;
  for (const c10::Device& device : result->devices()) {
    callers_streams.push_back(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  auto run = [sequencer, result, callers_streams = std::move(callers_streams), issue = std::move(issue),
              step = std::move(step)]() mutable {
    FuturePtr done;
    try {
      const c10::MultiStreamGuard on_callers_streams(callers_streams);  // none (CPU): changes nothing
      done = issue();
    } catch (...) {
      sequencer->fail(std::current_exception());
      result->setErrorIfNeeded(std::current_exception());
      return;
    }
    done->addCallback([sequencer, result, step = std::move(step)](c10::ivalue::Future& finished) mutable {
      if (finished.hasError()) {  // the sequencer first: no later ticket may go out once the error shows
        sequencer->fail(finished.exception_ptr());
        result->setErrorIfNeeded(finished.exception_ptr());
        return;
      }
      try {
        step();
      } catch (...) {
        sequencer->fail(std::current_exception());
        result->setErrorIfNeeded(std::current_exception());
      }
    });
  };
  auto abandon = [result, what = std::move(what), owner](std::exception_ptr first) {
    result->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(
        what + " was not issued: an earlier collective of this " + owner + " failed, which loses the order of "
        "collectives across ranks (build a new " + owner + " to go on). The first error: " + message_of(first))));
  };
  sequencer->submit(ticket, std::move(run), std::move(abandon));
}

}  // namespace shardkit::compress

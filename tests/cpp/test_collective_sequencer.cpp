// CollectiveSequencer: steps run in ticket order whatever order they are submitted in and whichever thread
// submits them; re-entrant submissions are drained, not recursed into; a failure abandons every later step.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/collective_sequencer.h"

using shardkit::core::CollectiveSequencer;

namespace {

std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
}

// Records what ran, in order (steps may run on several threads).
struct Log {
  std::mutex mutex;
  std::vector<std::string> entries;
  void add(std::string entry) {
    std::lock_guard<std::mutex> lock(mutex);
    entries.push_back(std::move(entry));
  }
};

CollectiveSequencer::Abandon must_not_abandon(std::string what) {
  return [what](std::exception_ptr error) { ADD_FAILURE() << what << " abandoned: " << message_of(error); };
}

}  // namespace

TEST(CollectiveSequencer, StepsRunInTicketOrderWhateverTheSubmissionOrder) {
  CollectiveSequencer sequencer;
  Log log;
  const uint64_t first = sequencer.reserve(4);
  EXPECT_EQ(first, 0u);
  for (uint64_t ticket : {3u, 1u, 2u}) {  // none is next: all stored
    sequencer.submit(ticket, [&log, ticket] { log.add(std::to_string(ticket)); }, must_not_abandon("later step"));
  }
  EXPECT_TRUE(log.entries.empty());
  sequencer.submit(0, [&log] { log.add("0"); }, must_not_abandon("step 0"));  // runs 0, then drains 1, 2, 3
  EXPECT_EQ(log.entries, (std::vector<std::string>{"0", "1", "2", "3"}));
  EXPECT_EQ(sequencer.next(), 4u);
  EXPECT_EQ(sequencer.reserve(2), 4u);  // tickets keep counting
}

TEST(CollectiveSequencer, ReentrantSubmissionIsDrainedNotRecursedInto) {
  // Issuing a collective may complete it inline; its callback then submits the next step on the same
  // thread, inside the running step. That step must run after the current one returns, not inside it.
  CollectiveSequencer sequencer;
  Log log;
  sequencer.reserve(3);
  std::function<void(uint64_t)> step = [&](uint64_t ticket) {
    log.add("begin " + std::to_string(ticket));
    if (ticket + 1 < 3) {
      sequencer.submit(ticket + 1, [&step, ticket] { step(ticket + 1); }, must_not_abandon("chained step"));
    }
    log.add("end " + std::to_string(ticket));
  };
  sequencer.submit(0, [&step] { step(0); }, must_not_abandon("step 0"));
  EXPECT_EQ(log.entries,
            (std::vector<std::string>{"begin 0", "end 0", "begin 1", "end 1", "begin 2", "end 2"}));
}

TEST(CollectiveSequencer, SubmittingNeverWaitsForATurn) {
  // The autograd thread submits the first step of ten buckets while bucket 0's chain is stalled: every
  // submit must return at once (the test would hang otherwise), having run only bucket 0's step.
  CollectiveSequencer sequencer;
  Log log;
  std::vector<uint64_t> firsts;
  for (int bucket = 0; bucket < 10; ++bucket) {
    firsts.push_back(sequencer.reserve(2));
    sequencer.submit(firsts.back(), [&log, bucket] { log.add("A" + std::to_string(bucket)); },
                     must_not_abandon("first step"));
  }
  EXPECT_EQ(log.entries, (std::vector<std::string>{"A0"}));
  // Bucket 0's second collective becomes ready (its first one completed): it runs, then all the rest.
  sequencer.submit(firsts[0] + 1, [&log] { log.add("B0"); }, must_not_abandon("B0"));
  EXPECT_EQ(log.entries, (std::vector<std::string>{"A0", "B0", "A1"}));
}

// A fake process group: issue() records the collective's name (the order a peer would see), and its
// completion runs later on one of several "completion threads", in random order, as gloo's threads do.
class FakeGroup {
 public:
  explicit FakeGroup(unsigned seed, int threads) : rng_(seed) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { serve(); });
  }
  ~FakeGroup() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& worker : workers_) worker.join();
  }
  void issue(const std::string& name, std::function<void()> on_done) {
    std::lock_guard<std::mutex> lock(mutex_);
    issued_.push_back(name);
    // Insert at a random place: completions overtake each other.
    std::uniform_int_distribution<size_t> where(0, pending_.size());
    pending_.insert(pending_.begin() + static_cast<std::ptrdiff_t>(where(rng_)), std::move(on_done));
    ready_.notify_one();
  }
  std::vector<std::string> issued() {
    std::lock_guard<std::mutex> lock(mutex_);
    return issued_;
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      ready_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;
      auto done = std::move(pending_.front());
      pending_.pop_front();
      const auto pause = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 200)(rng_));
      lock.unlock();
      std::this_thread::sleep_for(pause);
      done();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> pending_;
  std::vector<std::string> issued_;
  std::mt19937 rng_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

TEST(CollectiveSequencer, PowerSGDPatternIssuesInBucketThenPhaseOrder) {
  // Per bucket, PowerSGD's three collectives: U and P chained from callbacks, as the hook does. The
  // "autograd thread" launches the buckets back to back; completions arrive out of order on three
  // threads. The group must see U0 P0 Q0 U1 P1 Q1 ... on every run.
  constexpr int kBuckets = 12, kPhases = 3, kRuns = 30;
  const char* phase_names[kPhases] = {"U", "P", "Q"};
  for (int run = 0; run < kRuns; ++run) {
    auto sequencer = std::make_shared<CollectiveSequencer>();
    std::atomic<int> finished{0};
    {
      FakeGroup group(/*seed=*/1000 + run, /*threads=*/3);
      // Issues phase `phase` of `bucket` in its turn; its completion submits the next phase.
      std::function<void(int, uint64_t, int)> launch = [&](int bucket, uint64_t first, int phase) {
        sequencer->submit(
            first + phase,
            [&, bucket, first, phase] {
              group.issue(phase_names[phase] + std::to_string(bucket), [&, bucket, first, phase] {
                if (phase + 1 < kPhases) {
                  launch(bucket, first, phase + 1);
                } else {
                  ++finished;
                }
              });
            },
            must_not_abandon("bucket step"));
      };
      for (int bucket = 0; bucket < kBuckets; ++bucket) launch(bucket, sequencer->reserve(kPhases), 0);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (finished < kBuckets && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_EQ(finished.load(), kBuckets) << "run " << run << ": buckets stuck";
      std::vector<std::string> want;
      for (int bucket = 0; bucket < kBuckets; ++bucket) {
        for (const char* phase : phase_names) want.push_back(phase + std::to_string(bucket));
      }
      EXPECT_EQ(group.issued(), want) << "run " << run;
    }
    EXPECT_EQ(sequencer->next(), static_cast<uint64_t>(kBuckets * kPhases));
  }
}

TEST(CollectiveSequencer, AFailedStepAbandonsEveryLaterStep) {
  CollectiveSequencer sequencer;
  Log log;
  sequencer.reserve(4);
  std::vector<std::string> abandoned;
  const auto record = [&abandoned](std::string who) {
    return [&abandoned, who](std::exception_ptr error) { abandoned.push_back(who + ": " + message_of(error)); };
  };
  sequencer.submit(2, [&log] { log.add("2"); }, record("2"));  // stored behind ticket 1
  sequencer.submit(0, [&log] { log.add("0"); }, must_not_abandon("step 0"));
  sequencer.submit(1, [] { throw std::runtime_error("allreduce refused"); }, record("1"));
  EXPECT_TRUE(sequencer.failed());
  EXPECT_EQ(log.entries, (std::vector<std::string>{"0"}));
  // The failed step hears of its own error; the stored one behind it is abandoned with it, not left waiting.
  EXPECT_EQ(abandoned, (std::vector<std::string>{"2: allreduce refused", "1: allreduce refused"}));
  // Later submissions (the next bucket) are abandoned at once with the first error.
  sequencer.submit(3, [&log] { log.add("3"); }, record("3"));
  const uint64_t later = sequencer.reserve(1);
  sequencer.submit(later, [&log] { log.add("later"); }, record("later"));
  EXPECT_EQ(log.entries, (std::vector<std::string>{"0"}));
  EXPECT_EQ(abandoned.back(), "later: allreduce refused");
  EXPECT_EQ(abandoned.size(), 4u);
}

TEST(CollectiveSequencer, FailFromOutsideAbandonsStoredStepsAndKeepsTheFirstError) {
  // A collective's Future failing (reported by the glue through fail()) while the next bucket waits.
  CollectiveSequencer sequencer;
  sequencer.reserve(3);
  std::vector<std::string> abandoned;
  sequencer.submit(0, [] {}, must_not_abandon("step 0"));
  sequencer.submit(2, [] { ADD_FAILURE() << "step 2 ran"; },
                   [&abandoned](std::exception_ptr e) { abandoned.push_back(message_of(e)); });
  sequencer.fail(std::make_exception_ptr(std::runtime_error("peer 1 closed the connection")));
  sequencer.fail(std::make_exception_ptr(std::runtime_error("a later error")));
  sequencer.submit(1, [] { ADD_FAILURE() << "step 1 ran"; },
                   [&abandoned](std::exception_ptr e) { abandoned.push_back(message_of(e)); });
  EXPECT_EQ(abandoned, (std::vector<std::string>{"peer 1 closed the connection", "peer 1 closed the connection"}));
}

TEST(CollectiveSequencer, RefusesUnreservedAndRepeatedTickets) {
  CollectiveSequencer sequencer;
  EXPECT_THROW(sequencer.reserve(0), std::invalid_argument);
  sequencer.reserve(2);
  try {
    sequencer.submit(5, [] {}, [](std::exception_ptr) {});
    ADD_FAILURE() << "ticket 5 accepted";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "CollectiveSequencer::submit: ticket 5 was never reserved (reserved: 2)");
  }
  sequencer.submit(1, [] {}, [](std::exception_ptr) {});
  EXPECT_THROW(sequencer.submit(1, [] {}, [](std::exception_ptr) {}), std::logic_error);  // stored already
  sequencer.submit(0, [] {}, [](std::exception_ptr) {});
  try {
    sequencer.submit(0, [] {}, [](std::exception_ptr) {});
    ADD_FAILURE() << "ticket 0 accepted twice";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "CollectiveSequencer::submit: ticket 0 was submitted before (next to run: 2)");
  }
  EXPECT_FALSE(sequencer.failed());
}

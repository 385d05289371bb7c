#include "comm/failure_notices.h"

#include <algorithm>
#include <future>
#include <memory>
#include <set>
#include <thread>

namespace shardkit::comm {

namespace {

constexpr const char* kFailedPrefix = "shardkit/failed/";
constexpr const char* kDeathCount = "shardkit/deaths";
constexpr const char* kDeathPrefix = "shardkit/death/";
constexpr auto kPoll = std::chrono::milliseconds(20);

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

std::optional<std::string> get_if_set(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return std::nullopt;
  return text_of(store.get(key));
}

}  // namespace

FailureNotices::FailureNotices(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> job_store,
                               int rank, core::PeerNames ranks, std::vector<int> host_of)
    : store_(std::move(store)),
      job_store_(job_store ? std::move(job_store) : store_),
      rank_(rank),
      ranks_(std::move(ranks)),
      host_of_(std::move(host_of)) {}

template <typename T, typename Call>
std::optional<T> FailureNotices::ask(Call call) {
  if (!store_ || unreachable_.load(std::memory_order_relaxed)) return std::nullopt;
  // The thread owns what it uses (the Stores travel inside `call`): it may outlive this object.
  auto answer = std::make_shared<std::promise<std::optional<T>>>();
  std::future<std::optional<T>> future = answer->get_future();
  std::thread([answer, call = std::move(call)]() mutable {
    try {
      answer->set_value(std::optional<T>(call()));
    } catch (...) {
      answer->set_value(std::nullopt);
    }
  }).detach();
  if (future.wait_for(kStoreDeadline) != std::future_status::ready) {
    unreachable_.store(true, std::memory_order_relaxed);
    return std::nullopt;
  }
  return future.get();
}

void FailureNotices::mark_failed(const std::string& reason) {
  ask<bool>([store = store_, key = kFailedPrefix + std::to_string(rank_), reason] {
    store->set(key, bytes_of(reason));
    return true;
  });
}

std::string FailureNotices::publish(const std::string& reason) {
  mark_failed(reason);
  // compareSet writes only when the key is missing (expected ""), and returns what the key holds after.
  return ask<std::string>([store = store_, reason] {
           return text_of(store->compareSet(kAbortKey, {}, bytes_of(reason)));
         }).value_or(reason);
}

std::optional<std::string> FailureNotices::root_cause() {
  std::lock_guard<std::mutex> lock(deaths_mutex_);
  struct Found {
    std::optional<std::string> cause;
    int64_t deaths_read;
  };
  std::optional<Found> found = ask<Found>([store = store_, job = job_store_, members = ranks_.names,
                                          read = deaths_read_]() mutable {
    if (auto reason = get_if_set(*store, kAbortKey)) return Found{reason, read};
    const int64_t recorded = job->add(kDeathCount, 0);
    for (; read < recorded; ++read) {
      const std::string record = text_of(job->get(kDeathPrefix + std::to_string(read + 1)));
      const size_t space = record.find(' ');
      const int dead = std::stoi(record.substr(0, space));
      if (std::find(members.begin(), members.end(), dead) != members.end()) {
        return Found{record.substr(space + 1), read + 1};
      }
    }
    return Found{std::nullopt, read};
  });
  if (!found) return std::nullopt;
  deaths_read_ = found->deaths_read;
  return found->cause;
}

std::optional<std::string> FailureNotices::await_root_cause(std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  for (;;) {
    if (auto reason = root_cause()) return reason;
    if (std::chrono::steady_clock::now() >= deadline || unreachable_.load()) return std::nullopt;
    std::this_thread::sleep_for(kPoll);
  }
}

void FailureNotices::record_deaths(const std::vector<std::pair<int, int32_t>>& exited, const std::string& message) {
  if (exited.empty() || !job_store_ || unreachable_.load(std::memory_order_relaxed)) return;
  std::thread([job = job_store_, exited, message] {
    try {
      for (const auto& [rank, pid] : exited) {
        (void)pid;  // the message names it
        // The record is written under its number after the count says it exists: a reader that sees the count
        // first waits for it in get() (a Store get blocks until the key is set), which is at once here.
        const int64_t number = job->add(kDeathCount, 1);
        job->set(kDeathPrefix + std::to_string(number), bytes_of(std::to_string(rank) + " " + message));
      }
    } catch (const std::exception&) {
      // the Store is gone: the death stays unrecorded, and the others name what they see themselves
    }
  }).detach();
}

std::string FailureNotices::silent_ranks() {
  if (host_of_.empty()) return {};
  const int mine = host_of_.at(rank_);
  std::vector<std::string> keys;
  std::vector<int> hosts;
  for (int r = 0; r < static_cast<int>(host_of_.size()); ++r) {
    if (host_of_[r] == mine) continue;
    keys.push_back(kFailedPrefix + std::to_string(r));
    hosts.push_back(host_of_[r]);
  }
  std::optional<std::set<int>> spoke = ask<std::set<int>>([store = store_, keys, hosts] {
    std::set<int> heard;  // hosts one of whose ranks marked itself failed
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!heard.count(hosts[i]) && store->check({keys[i]})) heard.insert(hosts[i]);
    }
    return heard;
  });
  if (!spoke) return {};  // the Store is gone: nothing can be told apart
  std::vector<std::pair<int, int32_t>> silent;
  for (int r = 0; r < static_cast<int>(host_of_.size()); ++r) {
    if (host_of_[r] != mine && !spoke->count(host_of_[r])) silent.emplace_back(ranks_.name(r), ranks_.pid(r));
  }
  std::string text;
  for (const auto& [name, pid] : silent) {
    text += (text.empty() ? "" : ", ") + std::to_string(name) +
            (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string(" (pid unknown)"));
  }
  return text;
}

}  // namespace shardkit::comm

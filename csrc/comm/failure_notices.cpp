#include "comm/failure_notices.h"

#include <algorithm>
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

}  // namespace

FailureNotices::FailureNotices(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> job_store,
                               int rank, std::vector<int> global_ranks, std::vector<int> host_of,
                               std::vector<int32_t> pids)
    : store_(std::move(store)),
      job_store_(job_store ? std::move(job_store) : store_),
      rank_(rank),
      global_ranks_(std::move(global_ranks)),
      host_of_(std::move(host_of)),
      pids_(std::move(pids)) {}

std::optional<std::string> FailureNotices::get_if_set(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const std::string& key) {
  if (!store || !store->check({key})) return std::nullopt;
  return text_of(store->get(key));
}

std::string FailureNotices::publish(const std::string& reason) {
  if (!store_) return reason;
  try {
    store_->set(kFailedPrefix + std::to_string(rank_), bytes_of(reason));
    // compareSet writes only when the key is missing (expected ""), and returns what the key holds after.
    return text_of(store_->compareSet(kAbortKey, {}, bytes_of(reason)));
  } catch (const std::exception&) {
    return reason;
  }
}

std::optional<std::string> FailureNotices::root_cause() {
  try {
    if (auto reason = get_if_set(store_, kAbortKey)) return reason;
    if (!job_store_) return std::nullopt;
    const int64_t recorded = job_store_->add(kDeathCount, 0);
    for (; deaths_read_ < recorded; ++deaths_read_) {
      const std::string record = text_of(job_store_->get(kDeathPrefix + std::to_string(deaths_read_ + 1)));
      const size_t space = record.find(' ');
      const int dead = std::stoi(record.substr(0, space));
      if (std::find(global_ranks_.begin(), global_ranks_.end(), dead) != global_ranks_.end()) {
        return record.substr(space + 1);
      }
    }
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

std::optional<std::string> FailureNotices::await_root_cause(std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  for (;;) {
    if (auto reason = root_cause()) return reason;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(kPoll);
  }
}

void FailureNotices::record_deaths(const std::vector<std::pair<int, int32_t>>& exited, const std::string& message) {
  if (!job_store_) return;
  try {
    for (const auto& [rank, pid] : exited) {
      (void)pid;  // the message names it
      // The record is written under its number after the count says it exists: a reader that sees the count
      // first waits for it in get() (a Store get blocks until the key is set), which is at once here.
      const int64_t number = job_store_->add(kDeathCount, 1);
      job_store_->set(kDeathPrefix + std::to_string(number), bytes_of(std::to_string(rank) + " " + message));
    }
  } catch (const std::exception&) {
  }
}

std::string FailureNotices::silent_ranks() {
  if (host_of_.empty()) return {};
  std::set<int> spoke;  // hosts one of whose ranks marked itself failed
  const int mine = host_of_.at(rank_);
  try {
    for (int r = 0; r < static_cast<int>(host_of_.size()); ++r) {
      if (host_of_[r] == mine || spoke.count(host_of_[r])) continue;
      if (store_ && store_->check({kFailedPrefix + std::to_string(r)})) spoke.insert(host_of_[r]);
    }
  } catch (const std::exception&) {
    return {};  // the Store is gone: nothing can be told apart
  }
  std::string silent;
  for (int r = 0; r < static_cast<int>(host_of_.size()); ++r) {
    if (host_of_[r] == mine || spoke.count(host_of_[r])) continue;
    const int32_t pid = r < static_cast<int>(pids_.size()) ? pids_[r] : 0;
    silent += (silent.empty() ? "" : ", ") + std::to_string(global_rank(r)) +
              (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string(" (pid unknown)"));
  }
  return silent;
}

}  // namespace shardkit::comm

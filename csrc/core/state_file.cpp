#include "core/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace shardkit::core {

namespace {

std::string reason(int err) { return std::system_category().message(err); }

size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

}  // namespace

// --- AlignedBuffer ------------------------------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(size_t bytes) : bytes_(bytes) {
  void* data = nullptr;
  const size_t rounded = round_up(bytes == 0 ? 1 : bytes, StateFile::kAlignment);
  if (posix_memalign(&data, StateFile::kAlignment, rounded) != 0) {
    throw std::runtime_error("shardkit state file: cannot allocate an aligned buffer of " + std::to_string(rounded) +
                             " bytes");
  }
  data_ = static_cast<uint8_t*>(data);
  std::memset(data_, 0, rounded);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

// --- StateFile ----------------------------------------------------------------------------------------------------

StateFile::StateFile(std::string path, size_t bytes, bool want_direct)
    : path_(std::move(path)), bytes_(round_up(bytes, kAlignment)) {
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  if (want_direct) {
    fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0600);
    if (fd_ >= 0) {
      direct_ = true;
    } else if (errno == EINVAL) {  // the filesystem refuses O_DIRECT (it may have made the file first)
      direct_refused_ = "the filesystem refuses O_DIRECT (" + reason(EINVAL) + ")";
      ::unlink(path_.c_str());
    } else {
      fail("cannot create it", errno);
    }
  } else {
    direct_refused_ = "direct I/O not asked for";
  }
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), flags, 0600);
    if (fd_ < 0) fail("cannot create it", errno);
  }
  if (const int err = posix_fallocate(fd_, 0, static_cast<off_t>(bytes_)); err != 0) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
    fail("cannot reserve " + std::to_string(bytes_) + " bytes", err);
  }
}

StateFile::~StateFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
}

void StateFile::fail(const std::string& what, int err) const {
  throw std::runtime_error("shardkit state file " + path_ + ": " + what + ": " + reason(err));
}

void StateFile::check_request(const char* what, size_t offset, const void* buffer, size_t length) const {
  if (offset + length > bytes_ || offset + length < offset) {
    throw std::runtime_error("shardkit state file " + path_ + ": " + what + " of " + std::to_string(length) +
                             " bytes at " + std::to_string(offset) + " goes past its " + std::to_string(bytes_) +
                             " bytes");
  }
  if (direct_ && (offset % kAlignment != 0 || length % kAlignment != 0 ||
                  reinterpret_cast<uintptr_t>(buffer) % kAlignment != 0)) {
    throw std::runtime_error("shardkit state file " + path_ + ": " + what + " of " + std::to_string(length) +
                             " bytes at " + std::to_string(offset) + " is not aligned to " +
                             std::to_string(kAlignment) + " bytes (offset, length and buffer), as direct I/O needs");
  }
}

void StateFile::read_at(size_t offset, void* buffer, size_t length) const {
  check_request("a read", offset, buffer, length);
  size_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd_, static_cast<uint8_t*>(buffer) + done, length - done,
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("reading " + std::to_string(length) + " bytes at " + std::to_string(offset), errno);
    }
    if (n == 0) {
      throw std::runtime_error("shardkit state file " + path_ + ": reading " + std::to_string(length) +
                               " bytes at " + std::to_string(offset) + ": the file ends at byte " +
                               std::to_string(offset + done) + " (truncated under the optimizer?)");
    }
    done += static_cast<size_t>(n);  // a short read: go on from there
  }
}

void StateFile::write_at(size_t offset, const void* buffer, size_t length) const {
  check_request("a write", offset, buffer, length);
  size_t done = 0;
  while (done < length) {
    const ssize_t n = ::pwrite(fd_, static_cast<const uint8_t*>(buffer) + done, length - done,
                               static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("writing " + std::to_string(length) + " bytes at " + std::to_string(offset), errno);
    }
    done += static_cast<size_t>(n);
  }
}

void StateFile::check() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("cannot stat it", errno);
  if (st.st_nlink == 0) {
    throw std::runtime_error("shardkit state file " + path_ + ": the file was removed under the optimizer");
  }
  if (static_cast<size_t>(st.st_size) < bytes_) {
    throw std::runtime_error("shardkit state file " + path_ + ": the file was truncated to " +
                             std::to_string(st.st_size) + " of its " + std::to_string(bytes_) + " bytes");
  }
}

// --- IoEngine -----------------------------------------------------------------------------------------------------

IoEngine::IoEngine(int threads) {
  if (threads < 1) throw std::invalid_argument("shardkit I/O engine: threads must be at least 1");
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

IoEngine::~IoEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_all();
  for (auto& worker : workers_) worker.join();
}

IoEngine::Ticket IoEngine::submit(Kind kind, const StateFile& file, size_t offset, void* buffer, size_t length) {
  Ticket ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = next_++;
    queue_.push_back(Request{ticket, kind, &file, offset, buffer, length});
    Outcome& outcome = outcomes_[ticket];
    outcome.what = std::string(kind == Kind::kRead ? "reading " : "writing ") + std::to_string(length) +
                   " bytes at " + std::to_string(offset) + " of " + file.path();
  }
  queued_.notify_one();
  return ticket;
}

void IoEngine::wait(Ticket ticket, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = outcomes_.find(ticket);
  if (it == outcomes_.end()) throw std::invalid_argument("shardkit I/O engine: unknown ticket " + std::to_string(ticket));
  if (!finished_.wait_until(lock, deadline, [&] { return outcomes_[ticket].done; })) {
    throw std::runtime_error("shardkit I/O engine: " + outcomes_[ticket].what + " did not finish by its deadline");
  }
  const std::exception_ptr error = outcomes_[ticket].error;
  outcomes_.erase(ticket);
  if (error) std::rethrow_exception(error);
}

void IoEngine::work() {
  for (;;) {
    Request request{};
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has started
      request = queue_.front();
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      if (request.kind == Kind::kRead) {
        request.file->read_at(request.offset, request.buffer, request.length);
      } else {
        request.file->write_at(request.offset, request.buffer, request.length);
      }
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Outcome& outcome = outcomes_[request.ticket];
      outcome.done = true;
      outcome.error = error;
    }
    finished_.notify_all();
  }
}

}  // namespace shardkit::core

// StateFile and IoEngine, torch-free: state that lives on disk and is read and written in chunks. The foundation of
// issue 42's offloaded optimizer (its moments and master weights streamed from a file per rank); nothing uses it
// from Python yet.
//
// StateFile promises:
//   - One file of a fixed size, made fresh (O_EXCL: never a file someone else holds), its blocks reserved at once
//     (posix_fallocate: a disk without the room fails here, naming the path and the bytes, not at some later write),
//     its name removed when the object ends.
//   - Direct I/O (O_DIRECT: no copy through the page cache, which would hold a second copy of the state) where the
//     filesystem takes it; buffered I/O otherwise, and direct_refused() says why. Under direct I/O offsets, lengths
//     and buffer addresses must be multiples of kAlignment: AlignedBuffer gives such buffers, and the file's size is
//     rounded up to one. A misaligned request is refused, naming the value.
//   - read_at / write_at move every byte or throw: a short transfer is continued, EINTR retried; a read that meets
//     the end of the file (truncated under us), a full disk and any other errno throw a std::runtime_error naming
//     the path, the offset, the length and the reason. check() says whether the file was removed or truncated
//     under us (between steps, for the caller to stop before it reads garbage).
// IoEngine promises: requests (a read or a write of a buffer at an offset of a StateFile) are started in submission
// order by `threads` workers (several overlap); wait(ticket, deadline) returns when that request is done, rethrows
// its error, or throws at the deadline naming the request. The engine orders nothing between requests in flight:
// the caller waits for a chunk's write before it submits the chunk's next read. The destructor lets the requests
// already queued finish.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace shardkit::core {

// Memory aligned for direct I/O (kAlignment), zero-filled.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

class StateFile {
 public:
  static constexpr size_t kAlignment = 4096;

  // Creates `path` (it must not exist) with room for `bytes` (rounded up to kAlignment); `want_direct` false: never
  // direct I/O.
  StateFile(std::string path, size_t bytes, bool want_direct = true);
  ~StateFile();  // closes and removes the name
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  const std::string& path() const { return path_; }
  size_t size() const { return bytes_; }
  bool direct() const { return direct_; }
  // Why direct I/O is off ("" where it is on).
  const std::string& direct_refused() const { return direct_refused_; }

  void read_at(size_t offset, void* buffer, size_t length) const;
  void write_at(size_t offset, const void* buffer, size_t length) const;
  // Throws, naming the path, where the file was removed or truncated since it was made.
  void check() const;

 private:
  void check_request(const char* what, size_t offset, const void* buffer, size_t length) const;
  [[noreturn]] void fail(const std::string& what, int err) const;

  std::string path_;
  size_t bytes_ = 0;
  int fd_ = -1;
  bool direct_ = false;
  std::string direct_refused_;
};

class IoEngine {
 public:
  enum class Kind { kRead, kWrite };
  using Ticket = uint64_t;

  explicit IoEngine(int threads);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // `file` and `buffer` must outlive the request (until wait() has returned for it).
  Ticket submit(Kind kind, const StateFile& file, size_t offset, void* buffer, size_t length);
  void wait(Ticket ticket, std::chrono::steady_clock::time_point deadline);

 private:
  struct Request {
    Ticket ticket;
    Kind kind;
    const StateFile* file;
    size_t offset;
    void* buffer;
    size_t length;
  };
  struct Outcome {
    bool done = false;
    std::exception_ptr error;
    std::string what;  // for a deadline's message
  };
  void work();

  std::mutex mutex_;  // guards below
  std::condition_variable queued_;
  std::condition_variable finished_;
  std::deque<Request> queue_;
  std::unordered_map<Ticket, Outcome> outcomes_;  // until waited for
  Ticket next_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace shardkit::core

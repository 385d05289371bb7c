// A POSIX shared-memory segment mapped by every rank of one host-local group.
//
// Promise: the segment exists in /dev/shm only between its creation and the moment every rank has mapped
// it. The creator (local rank 0) makes it with O_EXCL (a stale or foreign segment of the same name is an
// error, never silently shared), the others open it, each announces itself in the segment's attach
// counter, and the creator unlinks the name as soon as the counter reaches the group size (or on any
// failure). After that the memory lives only as long as some rank maps it, so a crash — kill -9 included —
// leaves nothing behind.
//
// The creator reserves the segment's pages (posix_fallocate): /dev/shm (tmpfs) charges pages only when they are
// first touched, so a segment past its free space would otherwise kill a rank with SIGBUS at some later write;
// reserved, it fails here, with a message.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace shardkit::core {

class ShmSegment {
 public:
  // Local rank 0 creates `name` (must start with '/') of `bytes` bytes; ranks 1..size-1 open it, retrying
  // until it appears. Every rank then increments `attach_counter_offset`'s atomic<uint32_t>, and rank 0
  // waits for `size` attachments and unlinks. Throws std::runtime_error (naming the rank and the segment)
  // if anything fails or `timeout` passes first.
  // `abandoned`, if set, is asked while waiting (for the segment to appear, for the ranks to attach): a
  // non-empty answer ends the wait with a std::runtime_error carrying it (a group aborted by another rank).
  ShmSegment(const std::string& name, size_t bytes, int rank, int size, size_t attach_counter_offset,
             std::chrono::milliseconds timeout, const std::function<std::string()>& abandoned = {});
  ~ShmSegment();

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  uint8_t* data() const { return base_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  void unlink_name();

  std::string name_;
  size_t bytes_ = 0;
  uint8_t* base_ = nullptr;
  bool unlinked_ = false;
  bool creator_ = false;
};

}  // namespace shardkit::core

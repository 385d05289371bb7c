// A POSIX shared-memory segment mapped by every rank of one host-local group.
//
// Promise: the segment exists in /dev/shm only between its creation and the moment every rank has mapped
// it. The creator (local rank 0) makes it with O_EXCL (a stale or foreign segment of the same name is an
// error, never silently shared), the others open it, each announces itself in the segment's attach
// counter, and the creator unlinks the name as soon as the counter reaches the group size (or on any
// failure). After that the memory lives only as long as some rank maps it, so a crash — kill -9 included —
// leaves nothing behind.
//
// Start-up is bounded: while a rank waits (for the segment to appear, for the ranks to attach) it watches its
// peers' pids and asks `AttachWatch::abandoned`; a peer that exits, or an answer that the start-up failed
// elsewhere, ends the wait within kWatchEvery with an error naming the rank. Whoever gives up also removes the
// name from /dev/shm, so nothing stays there whichever rank dies when (the creator included); only if every rank
// of the host dies inside the attach window can the name outlive them.
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

#include "core/liveness.h"

namespace shardkit::core {

// What a rank watches while it waits in the attach protocol.
struct AttachWatch {
  PeerNames peers;  // the ranks of the group (this one included): their names for messages, their pids to watch
  // Asked while waiting: a non-empty answer ends the wait with a std::runtime_error carrying it (the group was
  // aborted, or its start-up failed on another rank or host).
  std::function<std::string()> abandoned;
};

class ShmSegment {
 public:
  // Local rank 0 creates `name` (must start with '/') of `bytes` bytes; ranks 1..size-1 open it, retrying
  // until it appears. Every rank then increments `attach_counter_offset`'s atomic<uint32_t>, and rank 0
  // waits for `size` attachments and unlinks. Throws std::runtime_error (naming the rank and the segment)
  // if anything fails, a watched peer exits, `watch.abandoned` answers, or `timeout` passes first.
  ShmSegment(const std::string& name, size_t bytes, int rank, int size, size_t attach_counter_offset,
             std::chrono::milliseconds timeout, const AttachWatch& watch = {});
  ~ShmSegment();

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // How often a waiting rank checks its peers' pids and asks `abandoned`.
  static constexpr std::chrono::milliseconds kWatchEvery{20};

  uint8_t* data() const { return base_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name from /dev/shm now, from any rank (idempotent): for a start-up that failed after this rank
  // attached, where the creator may be dead and will not remove it.
  void unlink_name();

 private:

  std::string name_;
  size_t bytes_ = 0;
  uint8_t* base_ = nullptr;
  bool unlinked_ = false;
  bool creator_ = false;
};

// Removes `name` from /dev/shm if it is there (a segment's name outlives its creator only between creation and the
// last rank's attach): for a rank whose start-up failed before it reached the segment, which the group's creator
// may have made and died with. Idempotent; returns whether a name was removed.
bool remove_segment_name(const std::string& name);

// Pages of shared memory that one rank writes in bursts (its region of a SharedBuffer, see shm_group.h), given
// back between bursts. Both are local to the calling process's mapping; the caller makes sure no rank reads the
// range meanwhile.
// release_shared_pages: the whole pages inside [data, data + bytes) go back to /dev/shm (MADV_REMOVE punches
// them out of the tmpfs file): every mapping reads zeros there afterwards, and nothing is charged until they
// are touched again. False, nothing changed, where the kernel cannot.
bool release_shared_pages(void* data, size_t bytes);
// reserve_shared_pages: every page touching [data, data + bytes) allocated and mapped writable now
// (MADV_POPULATE_WRITE), so that /dev/shm out of room is a false return, with the reason in `*why`, instead of
// SIGBUS at the first write. Also false where the kernel cannot (before Linux 5.14).
bool reserve_shared_pages(void* data, size_t bytes, std::string* why);

}  // namespace shardkit::core

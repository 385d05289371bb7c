#include "core/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace shardkit::core {
namespace {

// `rank`: as messages name it (the rank's global rank).
[[noreturn]] void fail(int rank, const std::string& name, const std::string& what, int err) {
  throw std::runtime_error("shardkit shm (rank " + std::to_string(rank) + "): " + what + " segment '" +
                           name + "': " + std::strerror(err));
}

}  // namespace

ShmSegment::ShmSegment(const std::string& name, size_t bytes, int rank, int size,
                       size_t attach_counter_offset, std::chrono::milliseconds timeout, const AttachWatch& watch)
    : name_(name), bytes_(bytes), creator_(rank == 0) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + timeout;
  const std::string me = "shardkit shm (rank " + std::to_string(watch.peers.name(rank)) + ")";
  std::vector<int> peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers.push_back(r);
  }
  // Ends the attach protocol on this rank: the mapping goes, and so does the name, whoever created it (a
  // creator that died left it; one that gave up removed it already: unlinking again is harmless).
  auto give_up = [&](const std::string& why) {
    if (base_ != nullptr) {
      munmap(base_, bytes_);
      base_ = nullptr;
    }
    unlink_name();
    throw std::runtime_error(why);
  };
  auto next_watch = clock::now();
  auto watch_peers = [&](const char* waiting_for) {
    const auto now = clock::now();
    if (now < next_watch) return;
    next_watch = now + kWatchEvery;
    if (const auto dead = watch.peers.exited(peers); !dead.empty()) {
      give_up(me + ": rank(s) " + describe_exited(dead) + " exited during start-up, while " + waiting_for +
              " segment '" + name + "'");
    }
    if (watch.abandoned) {
      if (const std::string why = watch.abandoned(); !why.empty()) give_up(why);
    }
  };
  int fd = -1;
  if (creator_) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) fail(watch.peers.name(rank), name, "cannot create", errno);
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      close(fd);
      unlink_name();
      fail(watch.peers.name(rank), name, "cannot size (" + std::to_string(bytes) + " bytes; is /dev/shm full?)", err);
    }
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0 && err != EOPNOTSUPP) {
      close(fd);
      unlink_name();
      fail(watch.peers.name(rank), name, "cannot reserve " + std::to_string(bytes) + " bytes (is /dev/shm full?) for", err);
    }
  } else {
    // The creator may not have made it yet; it may also be mid-ftruncate, so wait for the full size.
    for (;;) {
      fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd >= 0) {
        struct stat st{};
        if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= bytes) break;
        close(fd);
        fd = -1;
      } else if (errno != ENOENT) {
        fail(watch.peers.name(rank), name, "cannot open", errno);
      }
      watch_peers("waiting for local rank 0 to make");
      if (clock::now() > deadline) {
        give_up(me + ": segment '" + name + "' did not appear within " + std::to_string(timeout.count()) +
                " ms (did local rank 0 start?)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_err = errno;
  close(fd);
  if (mapped == MAP_FAILED) {
    if (creator_) unlink_name();
    fail(watch.peers.name(rank), name, "cannot map", map_err);
  }
  base_ = static_cast<uint8_t*>(mapped);

  auto* attached = reinterpret_cast<std::atomic<uint32_t>*>(base_ + attach_counter_offset);
  attached->fetch_add(1, std::memory_order_acq_rel);
  if (creator_) {
    while (attached->load(std::memory_order_acquire) < static_cast<uint32_t>(size)) {
      watch_peers("the host's ranks attached");
      if (clock::now() > deadline) {
        give_up("shardkit shm (rank " + std::to_string(watch.peers.name(0)) + "): only " +
                std::to_string(attached->load()) + " of " + std::to_string(size) +
                " local ranks attached to segment '" + name + "' within " + std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    unlink_name();
  }
}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (creator_) unlink_name();
}

bool remove_segment_name(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

void ShmSegment::unlink_name() {
  if (!unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

namespace {

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older C libraries lack the name
#endif

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

bool release_shared_pages(void* data, size_t bytes) {
  const uintptr_t page = page_size();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end <= begin) return true;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_REMOVE) == 0;
}

bool reserve_shared_pages(void* data, size_t bytes, std::string* why) {
  const uintptr_t page = page_size();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  if (end <= begin) return true;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0) return true;
  const int err = errno;
  if (why != nullptr) {
    *why = err == EFAULT ? "/dev/shm has no room for the " + std::to_string(end - begin) + " bytes asked"
                         : std::string("MADV_POPULATE_WRITE: ") + std::strerror(err);
  }
  return false;
}

}  // namespace shardkit::core

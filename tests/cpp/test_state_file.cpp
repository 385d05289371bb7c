// core::StateFile and core::IoEngine (state on disk, read and written in chunks): what is written comes back, through
// several workers at once and in order per chunk; direct I/O where the filesystem takes it, and the reason where it
// does not (tmpfs before Linux 6.6); a full disk, a truncated file, a removed file and a misaligned request each
// raise naming the path and the values; the name is gone once the object ends.
#include <gtest/gtest.h>

#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/state_file.h"

namespace {

using shardkit::core::AlignedBuffer;
using shardkit::core::IoEngine;
using shardkit::core::StateFile;
constexpr size_t kChunk = 64 * StateFile::kAlignment;  // 256 KiB

// A fresh directory under /tmp, removed (empty: the files remove their names) when the test ends.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/shardkit-state-file-XXXXXX";
    if (mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() { ::rmdir(path_.c_str()); }
  std::string operator/(const char* name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void fill(AlignedBuffer& buffer, uint32_t seed) {
  auto* words = reinterpret_cast<uint32_t*>(buffer.data());
  for (size_t i = 0; i < buffer.size() / 4; ++i) words[i] = seed * 2654435761u + static_cast<uint32_t>(i);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

auto in(double seconds) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

TEST(StateFile, WhatIsWrittenComesBackThroughSeveralWorkersAndTheNameGoes) {
  const TempDir dir;
  const std::string path = dir / "state";
  {
    StateFile file(path, 16 * kChunk - 100);  // rounded up to whole blocks
    EXPECT_EQ(file.size(), 16 * kChunk);
    EXPECT_TRUE(file.direct()) << file.direct_refused();  // /tmp is ext4 on these machines
    IoEngine engine(4);
    std::vector<std::unique_ptr<AlignedBuffer>> out, back;
    std::vector<IoEngine::Ticket> writes, reads;
    for (uint32_t c = 0; c < 16; ++c) {
      out.push_back(std::make_unique<AlignedBuffer>(kChunk));
      fill(*out.back(), c + 1);
      writes.push_back(engine.submit(IoEngine::Kind::kWrite, file, c * kChunk, out.back()->data(), kChunk));
    }
    for (uint32_t c = 0; c < 16; ++c) {
      engine.wait(writes[c], in(30));  // a chunk's write before its read: the caller orders them
      back.push_back(std::make_unique<AlignedBuffer>(kChunk));
      reads.push_back(engine.submit(IoEngine::Kind::kRead, file, c * kChunk, back.back()->data(), kChunk));
    }
    for (uint32_t c = 0; c < 16; ++c) {
      engine.wait(reads[c], in(30));
      EXPECT_EQ(std::memcmp(out[c]->data(), back[c]->data(), kChunk), 0) << "chunk " << c;
    }
    file.check();
    EXPECT_TRUE(exists(path));
  }
  EXPECT_FALSE(exists(path));
}

TEST(StateFile, BufferedWhereDirectIsNotAskedForAndAnyAlignmentThen) {
  const TempDir dir;
  const std::string path = dir / "state";
  StateFile file(path, 10000, /*want_direct=*/false);
  EXPECT_FALSE(file.direct());
  EXPECT_EQ(file.direct_refused(), "direct I/O not asked for");
  std::vector<uint8_t> out(1000, 7), back(1000, 0);
  file.write_at(123, out.data(), out.size());
  file.read_at(123, back.data(), back.size());
  EXPECT_EQ(out, back);
}

TEST(StateFile, RefusesWhatDirectIoCannotDoAndWhatGoesPastTheEnd) {
  const TempDir dir;
  const std::string path = dir / "state";
  StateFile file(path, kChunk);
  ASSERT_TRUE(file.direct()) << file.direct_refused();
  AlignedBuffer buffer(kChunk);
  EXPECT_EQ(error_of([&] { file.read_at(100, buffer.data(), StateFile::kAlignment); }),
            "shardkit state file " + path + ": a read of 4096 bytes at 100 is not aligned to 4096 bytes (offset, "
            "length and buffer), as direct I/O needs");
  EXPECT_EQ(error_of([&] { file.write_at(0, buffer.data() + 1, StateFile::kAlignment); }),
            "shardkit state file " + path + ": a write of 4096 bytes at 0 is not aligned to 4096 bytes (offset, "
            "length and buffer), as direct I/O needs");
  EXPECT_EQ(error_of([&] { file.read_at(kChunk, buffer.data(), StateFile::kAlignment); }),
            "shardkit state file " + path + ": a read of 4096 bytes at 262144 goes past its 262144 bytes");
}

TEST(StateFile, ATruncatedOrRemovedFileIsNamed) {
  const TempDir dir;
  const std::string path = dir / "state";
  StateFile file(path, 4 * kChunk);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(kChunk)), 0);
  EXPECT_EQ(error_of([&] { file.check(); }),
            "shardkit state file " + path + ": the file was truncated to 262144 of its 1048576 bytes");
  AlignedBuffer buffer(kChunk);
  EXPECT_EQ(error_of([&] { file.read_at(2 * kChunk, buffer.data(), kChunk); }),
            "shardkit state file " + path + ": reading 262144 bytes at 524288: the file ends at byte 524288 "
            "(truncated under the optimizer?)");
  IoEngine engine(2);  // the engine hands the same error to the waiter
  const auto ticket = engine.submit(IoEngine::Kind::kRead, file, 2 * kChunk, buffer.data(), kChunk);
  EXPECT_NE(error_of([&] { engine.wait(ticket, in(30)); }).find("the file ends at byte 524288"), std::string::npos);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  EXPECT_EQ(error_of([&] { file.check(); }),
            "shardkit state file " + path + ": the file was removed under the optimizer");
}

TEST(StateFile, AnExistingPathIsNeverTakenOver) {
  const TempDir dir;
  const std::string path = dir / "state";
  StateFile first(path, kChunk);
  EXPECT_EQ(error_of([&] { StateFile second(path, kChunk); }),
            "shardkit state file " + path + ": cannot create it: File exists");
}

// A disk without the room (a 1 MiB tmpfs, mounted in a mount namespace of a child process: root only) fails at
// creation, naming the path and the bytes, and leaves no file behind. tmpfs also shows direct I/O's fallback where the
// kernel refuses it there.
TEST(StateFile, AFullDiskFailsAtCreationNamingThePathAndTheBytes) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  const TempDir scratch;
  const std::string dir = scratch.path();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) {
      _exit(2);
    }
    const std::string path = dir + "/state";
    const std::string error = error_of([&] { StateFile file(path, 4 << 20); });
    const std::string want = "shardkit state file " + path + ": cannot reserve 4194304 bytes: No space left on device";
    if (error != want) {
      fprintf(stderr, "got: %s\nwant: %s\n", error.c_str(), want.c_str());
      _exit(3);
    }
    if (exists(path)) _exit(4);
    StateFile fits(path, 256 << 10);  // what fits is made, direct or with its reason
    if (!fits.direct() && fits.direct_refused().empty()) _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(IoEngine, AWaitPastItsDeadlineNamesTheRequest) {
  const TempDir dir;
  const std::string path = dir / "state";
  StateFile file(path, 256 * kChunk);  // 64 MiB
  AlignedBuffer buffer(256 * kChunk);
  IoEngine engine(1);
  // Queued behind 128 reads of 64 MiB on one worker (a quarter of a second even where the reads only zero-fill, as
  // of blocks never written): not done a moment after it is queued, however the threads are scheduled.
  std::vector<IoEngine::Ticket> ahead;
  for (int i = 0; i < 128; ++i) {
    ahead.push_back(engine.submit(IoEngine::Kind::kRead, file, 0, buffer.data(), 256 * kChunk));
  }
  const auto last = engine.submit(IoEngine::Kind::kRead, file, 0, buffer.data(), kChunk);
  EXPECT_EQ(error_of([&] { engine.wait(last, std::chrono::steady_clock::now()); }),
            "shardkit I/O engine: reading 262144 bytes at 0 of " + path + " did not finish by its deadline");
  for (const auto ticket : ahead) engine.wait(ticket, in(120));
  engine.wait(last, in(30));
}

}  // namespace

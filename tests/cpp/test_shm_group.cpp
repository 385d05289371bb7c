// ShmGroup protocol tests: threads and forked processes as ranks, no torch.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/reduce.h"
#include "core/shm_group.h"
#include "core/shm_segment.h"

using shardkit::core::DType;
using shardkit::core::ReduceOp;
using shardkit::core::ShmGroup;
using shardkit::core::release_shared_pages;
using shardkit::core::reserve_shared_pages;

namespace {

std::string unique_name() {
  static std::atomic<int> counter{0};
  return "/shardkit-gtest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

ShmGroup::Options options_for(const std::string& name, int rank, int size, size_t slot_bytes = 64 * 1024) {
  ShmGroup::Options options;
  options.name = name;
  options.rank = rank;
  options.size = size;
  options.slot_bytes = slot_bytes;  // small slots, so modest counts already take the chunked paths
  options.timeout = std::chrono::seconds(20);
  return options;
}

// Runs body(rank) on `size` threads; each thread's failure message (empty on success) is returned.
std::vector<std::string> run_threads(int size, const std::function<void(int)>& body) {
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

// Runs body(rank) in `size` forked processes; returns each exit status (0 = success).
std::vector<int> run_processes(int size, const std::function<int(int)>& body) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      alarm(30);  // a hung child dies instead of hanging the test
      int code = 1;
      try {
        code = body(rank);
      } catch (...) {
        code = 2;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

float input_value(int rank, size_t i) { return static_cast<float>((i % 251) * 0.5 + rank); }

}  // namespace

class AllReduceProcesses : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(AllReduceProcesses, SumMatchesReferenceOnEveryRank) {
  const auto [size, count] = GetParam();
  const std::string name = unique_name();
  auto codes = run_processes(size, [&](int rank) {
    ShmGroup group(options_for(name, rank, size));
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = input_value(rank, i);
    group.allreduce(data.data(), data.data(), count, DType::F32, ReduceOp::Sum);
    for (size_t i = 0; i < count; ++i) {
      float expected = 0;
      for (int r = 0; r < size; ++r) expected += input_value(r, i);
      if (data[i] != expected) return 3;
    }
    return 0;
  });
  for (int rank = 0; rank < size; ++rank) EXPECT_EQ(codes[rank], 0) << "rank " << rank;
}

INSTANTIATE_TEST_SUITE_P(WorldByCount, AllReduceProcesses,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{1000}, size_t{100003})));

// ZeRO's in-place all-gather: each rank's input is its own block of the output (chunked: count > slot).
TEST(ShmGroup, AllGatherInPlaceFromOwnBlock) {
  for (int size : {1, 2, 3}) {
    const size_t count = 20011;
    const std::string name = unique_name();
    auto errors = run_threads(size, [&](int rank) {
      ShmGroup group(options_for(name, rank, size));
      std::vector<float> flat(count * size, -1.0f);
      for (size_t i = 0; i < count; ++i) flat[rank * count + i] = static_cast<float>(i % 977) + 1000.0f * rank;
      group.allgather(flat.data() + rank * count, flat.data(), count, DType::F32);
      for (int r = 0; r < size; ++r)
        for (size_t i = 0; i < count; ++i)
          if (flat[r * count + i] != static_cast<float>(i % 977) + 1000.0f * r)
            throw std::runtime_error("in-place allgather: rank " + std::to_string(r) + " element " + std::to_string(i));
    });
    for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "world " << size << " rank " << rank;
  }
}

// One piece of every rank's block of a larger all-gather / reduce-scatter (the hierarchical engine's pipeline):
// rank r's block at r * stride, only the piece's `count` elements moved, the rest of each block left alone.
TEST(ShmGroup, StridedAllGatherAndReduceScatterMoveOnePieceOfEveryBlock) {
  for (int size : {1, 2, 3}) {
    const size_t stride = 300007, offset = 1000, count = 270001;  // count spans several 1 MiB slots
    const std::string name = unique_name();
    auto value = [](int rank, size_t i) { return static_cast<float>(i % 1013) + 2048.0f * rank; };
    auto errors = run_threads(size, [&](int rank) {
      ShmGroup group(options_for(name, rank, size));
      std::vector<float> mine(count), gathered(stride * size, -1.0f);
      for (size_t i = 0; i < count; ++i) mine[i] = value(rank, offset + i);
      group.allgather_strided(mine.data(), gathered.data() + offset, count, stride, DType::F32);
      for (int r = 0; r < size; ++r) {
        for (size_t i = 0; i < stride; ++i) {
          const bool in_piece = i >= offset && i < offset + count;
          if (gathered[r * stride + i] != (in_piece ? value(r, i) : -1.0f)) {
            throw std::runtime_error("allgather_strided: block " + std::to_string(r) + " element " + std::to_string(i));
          }
        }
      }
      std::vector<float> input(stride * size), out(count, -1.0f);
      for (size_t i = 0; i < input.size(); ++i) input[i] = value(rank, i);
      group.reduce_scatter_strided(input.data() + offset, stride, out.data(), count, DType::F32, ReduceOp::Sum);
      for (size_t i = 0; i < count; ++i) {
        float expected = 0;
        for (int r = 0; r < size; ++r) expected += value(r, rank * stride + offset + i);
        if (out[i] != expected) throw std::runtime_error("reduce_scatter_strided: element " + std::to_string(i));
      }
    });
    for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "world " << size << " rank " << rank;
  }
}

TEST(ShmGroup, EveryCollectiveWithThreadsAsRanks) {
  const int size = 3;
  const size_t count = 40000;  // > slot / size: several rounds for every op
  const std::string name = unique_name();
  auto errors = run_threads(size, [&](int rank) {
    ShmGroup group(options_for(name, rank, size));
    std::vector<int64_t> mine(count), gathered(count * size), blocks(count * size), out(count);
    for (size_t i = 0; i < count; ++i) mine[i] = static_cast<int64_t>(i) * 10 + rank;

    group.allgather(mine.data(), gathered.data(), count, DType::I64);
    for (int r = 0; r < size; ++r)
      for (size_t i = 0; i < count; ++i)
        if (gathered[r * count + i] != static_cast<int64_t>(i) * 10 + r) throw std::runtime_error("allgather");

    for (int r = 0; r < size; ++r)
      for (size_t i = 0; i < count; ++i) blocks[r * count + i] = rank * 1000 + r;
    group.reduce_scatter(blocks.data(), out.data(), count, DType::I64, ReduceOp::Max);
    for (size_t i = 0; i < count; ++i)
      if (out[i] != (size - 1) * 1000 + rank) throw std::runtime_error("reduce_scatter");

    std::vector<int64_t> data = mine;
    group.broadcast(data.data(), count, DType::I64, 1);
    for (size_t i = 0; i < count; ++i)
      if (data[i] != static_cast<int64_t>(i) * 10 + 1) throw std::runtime_error("broadcast");

    std::vector<int64_t> scattered(count);
    group.scatter(gathered.data(), scattered.data(), count, DType::I64, 2);
    for (size_t i = 0; i < count; ++i)
      if (scattered[i] != static_cast<int64_t>(i) * 10 + rank) throw std::runtime_error("scatter");

    std::vector<int64_t> reduced(count, -1);
    group.reduce(mine.data(), rank == 0 ? reduced.data() : nullptr, count, DType::I64, ReduceOp::Sum, 0);
    if (rank == 0)
      for (size_t i = 0; i < count; ++i)
        if (reduced[i] != static_cast<int64_t>(i) * 10 * size + (size * (size - 1)) / 2)
          throw std::runtime_error("reduce");

    // Uneven alltoall: rank s sends (s + d) * 7000 elements valued s * 100 + d to rank d.
    std::vector<size_t> send_counts(size), send_offsets(size), recv_counts(size), recv_offsets(size);
    size_t send_total = 0, recv_total = 0;
    for (int d = 0; d < size; ++d) {
      send_counts[d] = (rank + d) * 7000;
      send_offsets[d] = send_total;
      send_total += send_counts[d];
      recv_counts[d] = (d + rank) * 7000;
      recv_offsets[d] = recv_total;
      recv_total += recv_counts[d];
    }
    std::vector<int32_t> send(send_total), recv(recv_total, -1);
    for (int d = 0; d < size; ++d)
      for (size_t i = 0; i < send_counts[d]; ++i) send[send_offsets[d] + i] = rank * 100 + d;
    group.alltoall(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets, DType::I32);
    for (int s = 0; s < size; ++s)
      for (size_t i = 0; i < recv_counts[s]; ++i)
        if (recv[recv_offsets[s] + i] != s * 100 + rank) throw std::runtime_error("alltoall");
    group.barrier();
  });
  for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

TEST(ShmGroup, SegmentNameIsGoneOnceAllRanksMapped) {
  const std::string name = unique_name();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup group(options_for(name, rank, 2));
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      close(fd);
      throw std::runtime_error("segment still linked after construction");
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(ShmGroup, DisagreementIsReportedOnEveryRankWithBothSides) {
  const std::string name = unique_name();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup group(options_for(name, rank, 2));
    std::vector<float> data(10 + rank);
    group.allreduce(data.data(), data.data(), data.size(), DType::F32, ReduceOp::Sum);
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("ranks disagree on collective #2"), std::string::npos) << error;
    EXPECT_NE(error.find("allreduce #2 (f32 x 10, sum)"), std::string::npos) << error;
    EXPECT_NE(error.find("allreduce #2 (f32 x 11, sum)"), std::string::npos) << error;
  }
}

TEST(ShmGroup, DeadPeerIsReportedWithinTwoSeconds) {
  const std::string name = unique_name();
  auto codes = run_processes(3, [&](int rank) {
    ShmGroup group(options_for(name, rank, 3));
    group.barrier();
    if (rank == 2) _exit(0);  // dies without arriving at the allreduce
    std::vector<float> data(5000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      group.allreduce(data.data(), data.data(), data.size(), DType::F32, ReduceOp::Sum);
    } catch (const std::exception& error) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (std::string(error.what()).find("rank(s) 2 (pid") == std::string::npos) return 4;
      return waited < std::chrono::seconds(2) ? 0 : 5;
    }
    return 6;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], 0);
}

TEST(ShmGroup, TimeoutNamesTheMissingRank) {
  const std::string name = unique_name();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup group(options_for(name, rank, 2));
    group.set_timeout(std::chrono::milliseconds(300));
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      group.barrier();  // late: must find the group aborted, with the reason
      return;
    }
    group.barrier();
  });
  EXPECT_NE(errors[0].find("barrier #2 (rank 0): Timed out after 300 ms waiting for rank(s) [1]"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("Timed out after 300 ms"), std::string::npos) << errors[1];
}

// A host's group inside a larger process group: messages name the ranks as the process group numbers them,
// and the collective as the caller labelled it (here one step of a hierarchical allreduce).
TEST(ShmGroup, MessagesUseTheCallersRankNamesAndLabel) {
  const std::string name = unique_name();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup::Options options = options_for(name, rank, 2);
    options.rank_names = {4, 9};
    ShmGroup group(options);
    if (rank == 1) return;  // never arrives
    float value = 1;
    shardkit::core::CallInfo call{std::chrono::milliseconds(300), "allreduce", 17, true};
    group.reduce(&value, &value, 1, DType::F32, ReduceOp::Sum, 0, call);
  });
  EXPECT_NE(errors[0].find("allreduce #17 (step: reduce within the host, f32 x 1, sum, root 4) (rank 4): Timed out "
                           "after 300 ms waiting for rank(s) [9]"),
            std::string::npos)
      << errors[0];
}

// Regression: a peer that has already moved on to the next op rewrites its header while a slower rank
// still validates the previous one; that must never read as a disagreement (it did, before the header
// got its own seqlock version). Four processes on however few cores, thousands of back-to-back ops.
TEST(ShmGroup, BackToBackOpsNeverFalselyDisagree) {
  const std::string name = unique_name();
  auto codes = run_processes(4, [&](int rank) {
    ShmGroup group(options_for(name, rank, 4));
    std::vector<float> data(1024);
    for (int i = 0; i < 30000; ++i) {
      std::fill(data.begin(), data.end(), 1.0f);
      group.allreduce(data.data(), data.data(), data.size(), DType::F32, ReduceOp::Sum);
      if (data[0] != 4.0f) return 3;
    }
    return 0;
  });
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(codes[rank], 0) << "rank " << rank;
}

// Zero-copy allreduce in a shared buffer: the same bits as the slot path (which chunks by the slot size; the
// shared path does not), the bytes around the tensor untouched, the path counted, the segment name gone.
TEST(ShmGroup, SharedBufferAllReduceIsBitwiseTheSlotPath) {
  for (int size : {2, 3, 4}) {
    const std::string name = unique_name();
    auto errors = run_threads(size, [&](int rank) {
      ShmGroup group(options_for(name, rank, size));
      const size_t count = 50021;  // past the small-message size and the 64 KiB test slot
      const size_t offset_bytes = 128;
      auto buffer = group.share_buffer(offset_bytes + count * sizeof(float) + 64);
      // The creator (rank 0) unlinks the name once every rank mapped it, before its share_buffer returns.
      if (rank == 0) {
        const int fd = shm_open((name + ".buf1").c_str(), O_RDWR, 0600);
        if (fd >= 0) {
          close(fd);
          throw std::runtime_error("buffer segment still linked");
        }
      }
      uint8_t* mine = buffer->mine();
      std::memset(mine, 0x5A, buffer->bytes());
      auto* shared = reinterpret_cast<float*>(mine + offset_bytes);
      std::vector<float> ordinary(count);
      for (size_t i = 0; i < count; ++i) {
        // Values whose sum depends on the order of addition, so that a different order would show.
        ordinary[i] = shared[i] = std::ldexp(1.0f + static_cast<float>(i % 97) / 97.0f, static_cast<int>((i + rank * 7) % 40) - 20);
      }
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Product}) {
        group.allreduce(shared, shared, count, DType::F32, op);
        group.allreduce(ordinary.data(), ordinary.data(), count, DType::F32, op);
        if (std::memcmp(shared, ordinary.data(), count * sizeof(float)) != 0) throw std::runtime_error("bits differ");
      }
      for (size_t i = 0; i < offset_bytes; ++i)
        if (mine[i] != 0x5A) throw std::runtime_error("byte before the tensor changed");
      for (size_t i = offset_bytes + count * sizeof(float); i < buffer->bytes(); ++i)
        if (mine[i] != 0x5A) throw std::runtime_error("byte after the tensor changed");
      if (group.shared_ops() != 3) throw std::runtime_error("zero-copy path ran " + std::to_string(group.shared_ops()) + " times");
    });
    for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "world " << size << " rank " << rank;
  }
}

// A reduce-scatter whose input lies in a shared buffer reads the peers' inputs there: the slot path's bits,
// into a private output, into this rank's own block of the input, or into the input's first block (where the
// peers read: reduced aside, written once they are done), and the bytes around the input stay as they were.
TEST(ShmGroup, SharedBufferReduceScatterIsBitwiseTheSlotPath) {
  for (int size : {2, 3, 4}) {
    const std::string name = unique_name();
    auto errors = run_threads(size, [&](int rank) {
      ShmGroup group(options_for(name, rank, size));
      const size_t count = 20011;  // per rank: the input (size * count) is past the small-message size and the 64 KiB slot
      const size_t total = count * size;
      const size_t offset_bytes = 256;
      auto buffer = group.share_buffer(offset_bytes + total * sizeof(float) + 64);
      uint8_t* mine = buffer->mine();
      auto* shared = reinterpret_cast<float*>(mine + offset_bytes);
      std::vector<float> input(total);
      for (size_t i = 0; i < total; ++i) {
        input[i] = std::ldexp(1.0f + static_cast<float>(i % 89) / 89.0f, static_cast<int>((i + rank * 5) % 40) - 20);
      }
      auto fill = [&] {
        std::memset(mine, 0x5A, buffer->bytes());
        std::memcpy(shared, input.data(), total * sizeof(float));
      };
      uint64_t expected_zero_copy = 0;
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Product}) {
        std::vector<float> ordinary(count), zero_copy(count);
        group.reduce_scatter(input.data(), ordinary.data(), count, DType::F32, op);
        fill();
        group.reduce_scatter(shared, zero_copy.data(), count, DType::F32, op);
        ++expected_zero_copy;
        if (std::memcmp(zero_copy.data(), ordinary.data(), count * sizeof(float)) != 0) throw std::runtime_error("bits differ");
        for (size_t i = 0; i < offset_bytes; ++i)
          if (mine[i] != 0x5A) throw std::runtime_error("byte before the input changed");
        for (size_t i = offset_bytes + total * sizeof(float); i < buffer->bytes(); ++i)
          if (mine[i] != 0x5A) throw std::runtime_error("byte after the input changed");
        // In place: the output is this rank's own block of the shared input.
        fill();
        float* own_block = shared + rank * count;
        group.reduce_scatter(shared, own_block, count, DType::F32, op);
        ++expected_zero_copy;
        if (std::memcmp(own_block, ordinary.data(), count * sizeof(float)) != 0) throw std::runtime_error("in-place bits differ");
        // An output over the input's first block (a block the peers read, for every rank but 0).
        fill();
        group.reduce_scatter(shared, shared, count, DType::F32, op);
        ++expected_zero_copy;
        if (std::memcmp(shared, ordinary.data(), count * sizeof(float)) != 0) throw std::runtime_error("overlapping bits differ");
      }
      if (group.shared_ops() != expected_zero_copy) {
        throw std::runtime_error("zero-copy path ran " + std::to_string(group.shared_ops()) + " times, expected " +
                                 std::to_string(expected_zero_copy));
      }
    });
    for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "world " << size << " rank " << rank;
  }
}

// Pages of a shared buffer given back (release_shared_pages) read as zeros in every rank that maps them, only
// whole pages inside the range go, and reserved again they hold what is written next, for every rank to see.
TEST(ShmGroup, ReleasedSharedPagesReadZerosAndComeBackWhenReserved) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (page != 4096) GTEST_SKIP() << "regions are 4 KiB aligned; this test's page arithmetic assumes 4 KiB pages";
  {
    std::string why;
    std::vector<uint8_t> probe(page);
    if (!reserve_shared_pages(probe.data(), 1, &why) && why.find("MADV_POPULATE_WRITE") != std::string::npos) {
      GTEST_SKIP() << "the kernel cannot reserve pages: " << why;  // before Linux 5.14
    }
  }
  const std::string name = unique_name();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup group(options_for(name, rank, 2));
    auto buffer = group.share_buffer(8 * page);
    uint8_t* owner = buffer->region(0);
    if (rank == 0) std::memset(owner, 0xAB, 8 * page);
    group.barrier();
    if (rank == 0 && !release_shared_pages(owner + page + 1, 4 * page)) throw std::runtime_error("release refused");
    group.barrier();
    // [page + 1, 5 page + 1): pages 2, 3 and 4 are whole inside it; pages 0, 1 and 5.. keep their bytes.
    for (size_t i = 0; i < 8 * page; ++i) {
      const uint8_t want = i >= 2 * page && i < 5 * page ? 0 : 0xAB;
      if (owner[i] != want) throw std::runtime_error("byte " + std::to_string(i) + " reads " + std::to_string(owner[i]));
    }
    group.barrier();
    if (rank == 0) {
      std::string why;
      if (!reserve_shared_pages(owner + 2 * page, 3 * page, &why)) throw std::runtime_error("reserve failed: " + why);
      std::memset(owner + 2 * page, 0x5C, 3 * page);
    }
    group.barrier();
    if (owner[3 * page] != 0x5C) throw std::runtime_error("the reserved page's new bytes are not seen");
  });
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// allreduce_average divides inside the reduction: the bits of allreduce followed by divide_in_place, on the
// small path, the chunked slot path and in a shared buffer, for floats and (truncating) integers.
TEST(ShmGroup, AllReduceAverageIsBitwiseSumThenDivide) {
  const int size = 3;
  const std::string name = unique_name();
  auto errors = run_threads(size, [&](int rank) {
    ShmGroup group(options_for(name, rank, size));
    for (size_t count : {size_t{1000}, size_t{50021}}) {
      auto buffer = group.share_buffer(count * sizeof(float));
      auto* shared = reinterpret_cast<float*>(buffer->mine());
      std::vector<float> averaged(count), summed(count);
      std::vector<int32_t> int_averaged(count), int_summed(count);
      for (size_t i = 0; i < count; ++i) {
        shared[i] = averaged[i] = summed[i] = std::ldexp(1.0f + static_cast<float>(i % 89) / 89.0f, static_cast<int>((i + rank) % 30) - 15);
        int_averaged[i] = int_summed[i] = static_cast<int32_t>((i * 7919 + rank * 104729) % 2001) - 1000;
      }
      group.allreduce_average(shared, shared, count, DType::F32, size);
      group.allreduce_average(averaged.data(), averaged.data(), count, DType::F32, size);
      group.allreduce(summed.data(), summed.data(), count, DType::F32, ReduceOp::Sum);
      shardkit::core::divide_in_place(summed.data(), count, DType::F32, size);
      if (std::memcmp(averaged.data(), summed.data(), count * sizeof(float)) != 0) throw std::runtime_error("f32 average differs");
      if (std::memcmp(shared, summed.data(), count * sizeof(float)) != 0) throw std::runtime_error("shared f32 average differs");
      group.allreduce_average(int_averaged.data(), int_averaged.data(), count, DType::I32, size);
      group.allreduce(int_summed.data(), int_summed.data(), count, DType::I32, ReduceOp::Sum);
      shardkit::core::divide_in_place(int_summed.data(), count, DType::I32, size);
      if (int_averaged != int_summed) throw std::runtime_error("i32 average differs");
    }
  });
  for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// One rank has nobody to exchange with: allreduce, allreduce_average and reduce form the result in one pass from
// the input, which must give what the reduction of that one source gives (the slot path's element function) —
// a bool normalized to 0 or 1, an AVG divided — in place and out of place, on the small size and chunked.
TEST(ShmGroup, OneRankReducesItsInputAlone) {
  ShmGroup group(options_for(unique_name(), 0, 1));
  for (size_t count : {size_t{0}, size_t{1000}, size_t{50021}}) {  // 50021 f32: over the 64 KiB slot
    std::vector<float> in(count), expected(count);
    for (size_t i = 0; i < count; ++i) in[i] = std::ldexp(1.0f + static_cast<float>(i % 89) / 89.0f, static_cast<int>(i % 30) - 15);
    const std::vector<float> original = in;
    const void* sources[] = {original.data()};
    shardkit::core::reduce_into(expected.data(), sources, 1, count, DType::F32, ReduceOp::Max);
    std::vector<float> out(count, -1.0f);
    group.allreduce(in.data(), out.data(), count, DType::F32, ReduceOp::Max);
    EXPECT_EQ(out, expected) << count;
    EXPECT_EQ(in, original) << count;  // out of place: the input is left alone
    group.allreduce(in.data(), in.data(), count, DType::F32, ReduceOp::Max);
    EXPECT_EQ(in, expected) << count;

    shardkit::core::divide_in_place(expected.data(), count, DType::F32, 3);
    group.allreduce_average(in.data(), in.data(), count, DType::F32, 3);
    EXPECT_EQ(in, expected) << count;

    std::vector<uint8_t> flags(count), flags_expected(count), flags_out(count, 7);
    for (size_t i = 0; i < count; ++i) flags[i] = static_cast<uint8_t>(i % 3);  // 2 is true: the result holds 1
    const void* flag_sources[] = {flags.data()};
    shardkit::core::reduce_into(flags_expected.data(), flag_sources, 1, count, DType::Bool, ReduceOp::Sum);
    group.reduce(flags.data(), flags_out.data(), count, DType::Bool, ReduceOp::Sum, 0);
    EXPECT_EQ(flags_out, flags_expected) << count;
    if (count > 2) EXPECT_EQ(flags_out[2], 1);
  }
}

// A rank that cannot make a shared buffer's segment (here: a stale segment of the same name) aborts the group, so
// the others raise its reason at once instead of waiting out the deadline for a segment that never comes.
TEST(ShmGroup, SharedBufferFailureReachesEveryRankAtOnce) {
  const std::string name = unique_name();
  const int stale = shm_open((name + ".buf1").c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(stale, 0);
  close(stale);
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_threads(2, [&](int rank) {
    ShmGroup group(options_for(name, rank, 2));  // 20 s deadline
    group.share_buffer(1 << 16);
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  shm_unlink((name + ".buf1").c_str());
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("cannot create segment '" + name + ".buf1': File exists"), std::string::npos)
        << "rank " << rank << ": " << errors[rank];
  }
}

namespace {

// Runs body(rank, pids) in `size` forked processes that first learn each other's pids (as the backend's start-up
// exchange tells them) through anonymous shared memory; returns each exit status.
std::vector<int> run_processes_knowing_pids(int size, const std::function<int(int, std::vector<int32_t>)>& body) {
  auto* table = static_cast<std::atomic<int32_t>*>(
      mmap(nullptr, sizeof(std::atomic<int32_t>) * size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  for (int r = 0; r < size; ++r) new (&table[r]) std::atomic<int32_t>(0);
  auto codes = run_processes(size, [&](int rank) {
    table[rank].store(static_cast<int32_t>(getpid()));
    std::vector<int32_t> pids(size, 0);
    for (int r = 0; r < size; ++r) {
      while ((pids[r] = table[r].load()) == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return body(rank, pids);
  });
  munmap(table, sizeof(std::atomic<int32_t>) * size);
  return codes;
}

bool segment_exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0600);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// Exit codes of a surviving rank: 0 it raised in time naming the dead rank; 4 the message lacks it; 5 too late;
// 6 the start-up succeeded. A survivor stays alive a while after it raised (as a process raising into Python
// does), so that no other survivor sees it gone and names it too.
int expect_start_up_to_fail_naming(const ShmGroup::Options& options, const std::string& dead) {
  const auto start = std::chrono::steady_clock::now();
  int code = 6;
  try {
    ShmGroup group(options);
  } catch (const std::exception& error) {
    const auto waited = std::chrono::steady_clock::now() - start;
    code = waited < std::chrono::seconds(2) ? 0 : 5;
    if (std::string(error.what()).find("rank(s) " + dead + " (pid") == std::string::npos) {
      std::fprintf(stderr, "unexpected message: %s\n", error.what());
      code = 4;
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  return code;
}

}  // namespace

TEST(ShmGroupStartUp, APeerThatDiesBeforeAttachingIsNamedWithinTwoSeconds) {
  const std::string name = unique_name();
  auto codes = run_processes_knowing_pids(3, [&](int rank, std::vector<int32_t> pids) {
    if (rank == 2) _exit(0);  // dies in the attach window: the creator waits for it, the others in the first sync
    ShmGroup::Options options = options_for(name, rank, 3);
    options.pids = pids;
    options.rank_names = {10, 11, 12};
    return expect_start_up_to_fail_naming(options, "12");
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
  EXPECT_FALSE(segment_exists(name));
}

TEST(ShmGroupStartUp, ACreatorThatDiesWhileTheOthersAttachLeavesNothingInDevShm) {
  const std::string name = unique_name();
  auto codes = run_processes_knowing_pids(3, [&](int rank, std::vector<int32_t> pids) {
    ShmGroup::Options options = options_for(name, rank, 3);
    options.pids = pids;
    if (rank == 0) {
      // The creator dies once it has made the segment and waits for the others to attach: it never unlinks it.
      options.abandoned = []() -> std::string { _exit(0); };
      ShmGroup group(options);
      return 7;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100 * rank));  // attach after the creator is gone
    return expect_start_up_to_fail_naming(options, "0");
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
  EXPECT_FALSE(segment_exists(name));
}

TEST(ShmGroupStartUp, AFailureElsewhereEndsEveryWaitWithItsReason) {
  // Rank 0 never starts (its creation failed, say); the others wait for the segment until told why.
  const std::string name = unique_name();
  auto errors = run_threads(3, [&](int rank) {
    if (rank == 0) return;
    ShmGroup::Options options = options_for(name, rank, 3);
    options.abandoned = [] { return std::string("rank 0 failed: cannot reserve 4 MB (No space left on device)"); };
    ShmGroup group(options);
  });
  EXPECT_EQ(errors[1], "rank 0 failed: cannot reserve 4 MB (No space left on device)");
  EXPECT_EQ(errors[2], "rank 0 failed: cannot reserve 4 MB (No space left on device)");
  EXPECT_FALSE(segment_exists(name));
}

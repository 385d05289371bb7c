// Process-shared futex wait/wake on a 32-bit word in shared memory (Linux).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace shardkit::core {

// Sleeps while *word == expected, at most `timeout`. Returns on wake, timeout, signal or value change.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout);
// Wakes every process sleeping on `word`.
void futex_wake_all(std::atomic<uint32_t>* word);

}  // namespace shardkit::core

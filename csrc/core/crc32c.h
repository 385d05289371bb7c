// CRC32C (Castagnoli, the iSCSI / ext4 / RocksDB checksum) of byte buffers, torch-free: what shardkit records
// for every file of a checkpoint while writing it, and checks when loading.
//
// What callers can rely on:
//  * The standard CRC32C: reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF, so
//    crc32c_extend(0, "123456789", 9) == 0xE3069283.
//  * Incremental: crc32c_extend(crc32c_extend(0, a, n), b, m) equals the CRC of the n + m bytes a || b, so a
//    stream's checksum is built write by write, whatever the writes' sizes.
//  * Every path gives the same value: the SSE4.2 `crc32` instruction where the CPU has it (chosen once, at
//    the first call, from CPUID; three interleaved streams on long buffers, joined exactly), else a portable
//    slicing-by-8 table loop. No alignment is required; size 0 returns `crc` unchanged; sizes are size_t
//    (no 2 GiB limit). Thread-safe: no state is written after the one-time setup.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardkit::core {

// The CRC32C of the bytes that gave `crc` followed by data[0, size) (crc = 0 for a fresh checksum).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);

// What crc32c_extend dispatches to: "sse4.2" or "portable".
const char* crc32c_isa();

// --- testing and measuring: each path on its own -----------------------------------------------------------
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t size);
// True where this CPU can run crc32c_extend_hardware.
bool crc32c_hardware_available();
// The SSE4.2 path. Throws std::logic_error where crc32c_hardware_available() is false.
uint32_t crc32c_extend_hardware(uint32_t crc, const void* data, size_t size);

}  // namespace shardkit::core

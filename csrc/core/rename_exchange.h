// Atomic exchange of two paths, torch-free: how a checkpoint directory is replaced by a new one in one step
// (python/shardkit/checkpoint/_commit.py).
//
// Promise: rename_exchange(a, b) either swaps the two existing paths — files or directories, on one
// filesystem — in one atomic step (an observer, and a crash, sees both names before or both after, never
// one missing), or changes nothing and returns why. Linux renameat2(RENAME_EXCHANGE), through the system
// call itself, so a C library without the wrapper (glibc before 2.28) still has it.
#pragma once

namespace shardkit::core {

// 0 when exchanged, else the errno, nothing changed:
//   EINVAL, ENOTSUP / EOPNOTSUPP  this filesystem cannot exchange (the caller falls back to two renames)
//   ENOSYS                        this kernel or platform cannot (likewise)
//   ENOENT                        either path is missing
//   EXDEV                         the paths lie on different filesystems
//   other                         as rename(2) says (EACCES, EBUSY, ...)
int rename_exchange(const char* a, const char* b);

}  // namespace shardkit::core

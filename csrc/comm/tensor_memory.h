// Memory helpers on host tensors, for the fronts' buffers that the engines share or that writers take whole: an
// alias of exactly a view's bytes, and the pages of a shared buffer (ProcessGroupShardkit::shared_buffer, the
// zero-copy memory of core::SharedBuffer) given back and taken again between the bursts that write them.
// Used by fully_shard's resident memory (python/shardkit/fsdp/_resident_memory.py) and by the checkpoint package
// (checkpoint/_sharded_state.py), whatever front made the tensor; bound in bindings.cpp under the names of _C.pyi.
//
// Promise: no copy, ever. Each helper checks what it is given (TORCH_CHECK, the message names the helper and the
// offending value) and then works on the tensor's memory as it lies; the page helpers are core/shm_segment.h's on a
// byte range of a tensor, local to this process's mapping.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

namespace shardkit::comm {

// A tensor over the same memory as `view` whose storage is exactly `view`'s bytes and keeps `view`'s storage
// alive. A piece of a flat shard is a view of a larger storage; writers that copy such views, or write whole
// storages (torch.distributed.checkpoint's file writer clones them and keeps every clone until the file is
// done; torch.save writes the whole storage), take this one as it is. `view` must be contiguous; an empty
// one is returned as it is.
at::Tensor exact_storage_alias(const at::Tensor& view);

// The pages of bytes [offset, offset + nbytes) of `memory` (a shared buffer: a contiguous 1-D uint8 host tensor),
// for zero-copy memory that is written in bursts (core::release_shared_pages / reserve_shared_pages). release:
// false where the kernel cannot; reserve: the reason it could not (no room in /dev/shm, a kernel before 5.14).
bool release_memory_pages(const at::Tensor& memory, int64_t offset, int64_t nbytes);
std::optional<std::string> reserve_memory_pages(const at::Tensor& memory, int64_t offset, int64_t nbytes);

}  // namespace shardkit::comm

#include "comm/tensor_memory.h"

#include "core/shm_segment.h"

namespace shardkit::comm {

at::Tensor exact_storage_alias(const at::Tensor& view) {
  TORCH_CHECK(view.is_contiguous(), "shardkit exact_storage_alias: the tensor must be contiguous, got sizes ",
              view.sizes(), " and strides ", view.strides());
  if (view.numel() == 0) return view;
  // The deleter owns a reference to the viewed tensor: its storage lives as long as the alias's.
  return at::from_blob(
      view.data_ptr(), view.sizes(), [keep = view](void*) {}, view.options());
}

namespace {

uint8_t* memory_range(const at::Tensor& memory, int64_t offset, int64_t nbytes, const char* op) {
  TORCH_CHECK(memory.device().is_cpu() && memory.scalar_type() == at::kByte && memory.dim() == 1 &&
                  memory.is_contiguous(),
              op, ": expected a contiguous 1-D uint8 host tensor (a shared buffer), got ", memory.scalar_type(), " ",
              memory.sizes(), " on ", memory.device());
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= memory.numel(), op, ": bytes [", offset, ", ",
              offset + nbytes, ") are not inside the buffer's ", memory.numel());
  return static_cast<uint8_t*>(memory.data_ptr()) + offset;
}

}  // namespace

bool release_memory_pages(const at::Tensor& memory, int64_t offset, int64_t nbytes) {
  return core::release_shared_pages(memory_range(memory, offset, nbytes, "release_shared_pages"),
                                    static_cast<size_t>(nbytes));
}

std::optional<std::string> reserve_memory_pages(const at::Tensor& memory, int64_t offset, int64_t nbytes) {
  std::string why;
  if (core::reserve_shared_pages(memory_range(memory, offset, nbytes, "reserve_shared_pages"),
                                 static_cast<size_t>(nbytes), &why)) {
    return std::nullopt;
  }
  return why;
}

}  // namespace shardkit::comm

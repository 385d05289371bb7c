// Named spans in torch.profiler traces (and any other RecordFunction observer) for shardkit's C++ work.
//
// SHARDKIT_PROFILE_SPAN(label) opens a USER_SCOPE span (what Python's torch.profiler.record_function opens)
// that lasts to the end of the enclosing scope. `label` is an expression yielding a std::string; it is
// evaluated only while a profiler is observing, so a span costs one RecordFunction check otherwise.
//
// Labels follow one scheme, which docs/profiling.md documents and tests/python/test_profiler.py checks:
//   shardkit::<collective>                 c10d Work of the backend (async: from issue to completion)
//   shardkit::ddp.bucket[i]                DDP reducer: launching bucket i's reduction (or its comm hook)
//   shardkit::ddp.finalize                 DDP reducer: end of backward, waiting and copying back
//   shardkit::ddp.copy_bucket_to_grad[i]   DDP reducer: bucket i's averaged gradients into .grad
//   shardkit::ddp.rebuild_buckets         DDP reducer: the second iteration's bucket rebuild
//   shardkit::ddp.join_shadow_backward    DDP join(): a joined rank matching the others' backward collectives
//   shardkit::powersgd[i], shardkit::batched_powersgd[i], shardkit::bf16_compress[i], shardkit::fp16_compress[i]
//                                          comm hooks, bucket i (the hook's synchronous part)
// Python adds shardkit::ddp.forward, shardkit::fsdp.* and shardkit::zero.* (python/shardkit/_profiling.py).
#pragma once

#include <ATen/record_function.h>

#include <string>

#define SHARDKIT_PROFILE_CONCAT_INNER(a, b) a##b
#define SHARDKIT_PROFILE_CONCAT(a, b) SHARDKIT_PROFILE_CONCAT_INNER(a, b)

// The label is declared before the guard so that it outlives the guard's end callbacks, which may read it.
#define SHARDKIT_PROFILE_SPAN(label)                                                              \
  std::string SHARDKIT_PROFILE_CONCAT(shardkit_span_label_, __LINE__);                            \
  at::RecordFunction SHARDKIT_PROFILE_CONCAT(shardkit_span_, __LINE__)(at::RecordScope::USER_SCOPE); \
  if (SHARDKIT_PROFILE_CONCAT(shardkit_span_, __LINE__).isActive()) {                             \
    SHARDKIT_PROFILE_CONCAT(shardkit_span_label_, __LINE__) = (label);                            \
    SHARDKIT_PROFILE_CONCAT(shardkit_span_, __LINE__).before(SHARDKIT_PROFILE_CONCAT(shardkit_span_label_, __LINE__)); \
  }

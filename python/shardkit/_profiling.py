"""Named spans for torch.profiler around shardkit's Python-side work.

The labels follow the scheme in csrc/profile_span.h (``shardkit::ddp.forward``, ``shardkit::fsdp.all_gather[unit]``,
``shardkit::zero.step``, ...). A span costs one flag check unless a profiler is recording, so the per-step code
paths can carry them unconditionally.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from . import _torch_compat

_profiler_enabled = _torch_compat.profiler_enabled_check()
_NO_SPAN = contextlib.nullcontext()


def span(label: str, index: object = None) -> AbstractContextManager[object]:
    """``record_function(label)`` (or ``label[index]``) while a profiler records; a no-op context otherwise."""
    if not _profiler_enabled():
        return _NO_SPAN
    return torch.autograd.profiler.record_function(label if index is None else f"{label}[{index}]")

"""shardkit.hooks: gradient-compression comm hooks in C++ (csrc/compress/), for torch's DDP and shardkit's.

torch's names, defaults and semantics (torch.distributed.algorithms.ddp_comm_hooks), two ways to install:

    ddp.register_comm_hook(state, shardkit.hooks.powerSGD_hook)     # torch's API: a Python hook per bucket
    shardkit.hooks.register(ddp, state, "powersgd")                  # the C++ hook straight into the reducer

``register`` works on torch's ``DistributedDataParallel`` and on ``shardkit.DistributedDataParallel``; the
kinds are "powersgd", "batched_powersgd" (with a ``PowerSGDState``), "fp16" and "bf16" (with a process
group or None). Either way the algorithm runs in C++; through ``register_comm_hook`` torch still calls a
Python function per bucket, which enters C++ at once (and a Python callback hands torch its result).

Same seed, same compression: ``PowerSGDState`` draws its random Q matrices exactly as torch's does
(numpy's ``RandomState(random_seed)`` feeding ``torch.manual_seed``), so torch's hook and shardkit's give the
same gradients. ``state_dict()``/``load_state_dict()`` and pickling carry everything (iteration, error
feedback, P, Q, the generator), so a resumed run continues bit-identically.
"""

# No `from __future__ import annotations`: torch DDP checks the hooks' annotations as objects (dist.GradBucket).

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from . import _C, _torch_compat

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_wrapper", "bf16_compress_wrapper", "register"]

logger = logging.getLogger(__name__)

_OPTION_NAMES = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
                 "warm_start", "orthogonalization_epsilon", "random_seed", "batch_tensors_with_same_shape")


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("shardkit.hooks: the default process group is not initialised; call "
                           "torch.distributed.init_process_group first")
    return group


def _value(future: torch.futures.Future) -> torch.Tensor:
    return future.value()


def _tensor_future(native: Any) -> "torch.futures.Future[torch.Tensor]":
    """What a hook returns to torch: the C++ hook's future (its value the bucket's tensor list) as a future of the
    bucket's tensor."""
    return cast("torch.futures.Future[torch.Tensor]", native.then(_value))


class PowerSGDState:
    """torch's PowerSGDState (same arguments, defaults and validation); the state lives in C++.

    ``process_group=None`` means the default group. ``compression_stats_logging_frequency`` is kept for
    compatibility: shardkit does not log per-iteration statistics, ask ``compression_stats()`` instead.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                             "because PowerSGD can only be applied after the first two iterations in DDP.")
        if not 0 <= int(random_seed) < 2 ** 32:
            raise ValueError(f"random_seed must be in [0, 2**32) (numpy's RandomState), got {random_seed!r}")
        self.process_group = process_group
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        options = _C.PowerSGDOptions()
        for name, value in (("matrix_approximation_rank", matrix_approximation_rank),
                            ("start_powerSGD_iter", start_powerSGD_iter),
                            ("min_compression_rate", min_compression_rate),
                            ("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                            ("orthogonalization_epsilon", orthogonalization_epsilon),
                            ("random_seed", int(random_seed)),
                            ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            setattr(options, name, value)
        self._impl = _C.PowerSGDState(_group(process_group), options)
        self._options = {name: getattr(options, name) for name in _OPTION_NAMES}

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("_options", {})
        if name in options:  # matrix_approximation_rank, start_powerSGD_iter, ... (read-only)
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- torch's read-only views -----------------------------------------------------------------------
    @property
    def iter(self) -> int:
        return self._impl.counters()[0]

    @property
    def total_numel_before_compression(self) -> int:
        return self._impl.counters()[1]

    @property
    def total_numel_after_compression(self) -> int:
        return self._impl.counters()[2]

    def compression_stats(self) -> tuple[float, int, int]:
        """(compress_rate, numel_before_compression, numel_after_compression), as torch's. For "bytes before
        and after", multiply by the gradients' element size."""
        _, before, after = self._impl.counters()
        return (before / after if after > 0 else 0), before, after

    # --- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Options, iteration, statistics, error feedback, P, Q and the generator state (copies)."""
        snap = self._impl.snapshot()
        return {"options": dict(self._options),
                "compression_stats_logging_frequency": self.compression_stats_logging_frequency,
                "iter": snap.iter, "total_numel_before_compression": snap.numel_before,
                "total_numel_after_compression": snap.numel_after,
                "error_dict": dict(snap.error), "p_memory_dict": dict(snap.p), "q_memory_dict": dict(snap.q),
                "rng": {"key": torch.tensor(snap.rng_key, dtype=torch.int64), "pos": snap.rng_pos}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a state_dict() (its options must equal this state's: they shape the saved tensors)."""
        if state_dict["options"] != self._options:
            raise ValueError(f"PowerSGDState.load_state_dict: the saved options {state_dict['options']} differ from "
                             f"this state's {self._options}")
        snap = _C.PowerSGDSnapshot()
        snap.iter = int(state_dict["iter"])
        snap.numel_before = int(state_dict["total_numel_before_compression"])
        snap.numel_after = int(state_dict["total_numel_after_compression"])
        snap.error, snap.p, snap.q = (dict(state_dict[key]) for key in ("error_dict", "p_memory_dict", "q_memory_dict"))
        snap.rng_key = [int(word) for word in state_dict["rng"]["key"].tolist()]
        snap.rng_pos = int(state_dict["rng"]["pos"])
        self._impl.restore(snap)

    def __getstate__(self) -> dict[str, Any]:
        logger.warning("NOTE: Process group is not serializable and excluded from a saved state.")
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        logger.warning("NOTE: Process group will be set to a default group (i.e. the world size). If a different "
                       "group is desired, please set `self.process_group` after PowerSGD state is loaded.")
        self.__init__(None, **state["options"],  # type: ignore[misc]  # as torch's: a subclass's own __init__
                      compression_stats_logging_frequency=state["compression_stats_logging_frequency"])
        self.load_state_dict(state)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTION_NAMES:
            raise AttributeError(f"PowerSGDState.{name} is fixed at construction (the C++ state was built with it); "
                                 "build a new PowerSGDState to change it")
        super().__setattr__(name, value)
        if name == "process_group" and "_impl" in self.__dict__:
            self._impl.set_process_group(_group(value))


# --- hooks with torch's signatures ----------------------------------------------------------------------

def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, in C++ (csrc/compress/powersgd.cpp)."""
    return _tensor_future(state._impl.powersgd_hook(bucket))


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's batched_powerSGD_hook (the whole bucket as one square matrix), in C++."""
    return _tensor_future(state._impl.batched_powersgd_hook(bucket))


def fp16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16_compress_hook in C++: cast to float16, divide by the world size, allreduce, cast back."""
    return _tensor_future(_C.cast_compress_hook(_group(process_group), bucket, torch.float16))


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook in C++ (bfloat16)."""
    return _tensor_future(_C.cast_compress_hook(_group(process_group), bucket, torch.bfloat16))


def _cast_wrapper(dtype: torch.dtype, hook: Callable) -> Callable:
    def wrapped(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        future = hook(hook_state, bucket)

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            original.copy_(done.value())  # back into the full-precision bucket, in place
            return original

        return future.then(decompress)

    inner = getattr(hook, "__name__", repr(hook))
    wrapped.__name__ = wrapped.__qualname__ = f"{_dtype_name(dtype)}_compress_wrapper({inner})"
    return wrapped


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def fp16_compress_wrapper(hook: Callable) -> Callable:
    """torch's fp16_compress_wrapper: ``hook`` sees a float16 bucket; its result is cast back."""
    return _cast_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Callable) -> Callable:
    """torch's bf16_compress_wrapper (bfloat16)."""
    return _cast_wrapper(torch.bfloat16, hook)


# --- native registration ----------------------------------------------------------------------------------

_KINDS = ("powersgd", "batched_powersgd", "fp16", "bf16")


def check_state_group(state: Any, model_group: dist.ProcessGroup | None, what: str) -> None:
    """A PowerSGDState must reduce over the DDP model's process group (else ranks would disagree)."""
    if not isinstance(state, PowerSGDState):
        return
    mine = dist.get_process_group_ranks(_group(model_group))
    theirs = dist.get_process_group_ranks(_group(state.process_group))
    if mine != theirs:
        raise ValueError(f"{what} (rank {dist.get_rank()}): the PowerSGDState's process group (ranks {theirs}) "
                         f"differs from the DDP model's (ranks {mine})")


def register(ddp_model: Any, state: Any, kind: str) -> None:
    """Installs shardkit's C++ hook ``kind`` into ``ddp_model``'s reducer (torch's DDP or shardkit's): no
    Python runs per bucket. ``state``: a PowerSGDState for "powersgd"/"batched_powersgd", a process group or
    None (the default group) for "fp16"/"bf16". Like register_comm_hook, once per model."""
    if kind not in _KINDS:
        raise ValueError(f"shardkit.hooks.register: unknown kind {kind!r}; expected one of {', '.join(_KINDS)}")
    # shardkit's DDP (a torch DDP subclass) is the one whose reducer is shardkit's: no import of ddp, which
    # imports this module (imports run one way: ddp -> hooks).
    is_shardkit = isinstance(getattr(ddp_model, "reducer", None), _C.Reducer)
    if not is_shardkit and not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"shardkit.hooks.register: expected a DistributedDataParallel model (torch's or shardkit's), "
                        f"got {type(ddp_model).__name__}")
    powersgd = kind in ("powersgd", "batched_powersgd")
    if powersgd and not isinstance(state, PowerSGDState):
        raise TypeError(f"shardkit.hooks.register: kind {kind!r} needs a shardkit.hooks.PowerSGDState, "
                        f"got {type(state).__name__}")
    if not powersgd and state is not None and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"shardkit.hooks.register: kind {kind!r} takes a process group or None, "
                        f"got {type(state).__name__}")
    check_state_group(state, ddp_model.process_group, "shardkit.hooks.register")
    impl = state._impl if powersgd else None
    group = _group(ddp_model.process_group if powersgd else state)
    if is_shardkit:
        ddp_model._verify_same_comm_hook_everywhere(f"shardkit.hooks.register(kind={kind!r}) "
                                                    f"(state: {type(state).__name__})")
        ddp_model.reducer.register_native_comm_hook(kind, impl, group)
    else:
        _C.register_native_comm_hook_on_torch_reducer(ddp_model.reducer, kind, impl, group)
        _torch_compat.record_comm_hook(ddp_model, f"shardkit.hooks.{kind}", state)

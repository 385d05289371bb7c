"""Checkpoint pieces common to every shardkit flat layout: FSDP's flat parameters and ZeRO's per-dtype spaces.

A ``ShardedSpace`` is one ``_C.FlatLayout`` as a checkpoint sees it: its parameters' names and own shapes, the
group its shards are spread over, and this rank's place in that group. Everything a checkpoint does with a
parameter is asked of it:

- ``piece_tensor(index, local)``: this rank's piece of parameter ``index`` (or of an optimizer state tensor
  shaped like it) as a ``PieceTensor``: to torch.distributed.checkpoint (DCP) a tensor of the parameter's own
  shape of which this rank holds the boxes its piece covers (see PieceTensor) -- a pure function of the layout,
  so building it communicates nothing and copies nothing. So the checkpoint holds every parameter in its own
  shape, as torch FSDP2's does: DCP saves each rank's boxes from that rank and, on load at any world size, into
  any layout (shardkit's flat ones, FSDP2's dim-0 chunks), reads for each rank the boxes its own pieces need.
  (Checkpoints written before this held flattened parameters, with the own shapes beside them under
  ``SHAPES_KEY``; ``python -m shardkit checkpoint`` still reads them.)
- ``cut(index, whole)``: this rank's piece of a whole value (a view).
- ``gather(pieces)``: every parameter's whole value from every rank's pieces (one all-gather per call).

The model and optimizer state dicts of shardkit.FullyShardedDataParallel (fsdp/_state_dict.py) and of
shardkit.DistributedDataParallel / ZeroRedundancyOptimizer (shardkit/_zero_state_dict.py) are built from these,
with one format: a checkpoint saved by either loads into the other (the optimizer state always keyed by
parameter names; the model state too through shardkit.state_dict.get_state_dict). Those adapters live with their
fronts; this package imports no front (_front_protocol.py).

The name-keyed optimizer state dict (``optim_state_dict`` / ``local_optim_state``) is written once here, over
``Slot``s: one per parameter piece this rank's optimizer steps (FSDP: the sharded parameter itself; ZeRO: the
piece's leaf in the local optimizer).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import _C, _exchange, _flat, _torch_compat

# Checkpoints written before PieceTensor held flattened parameters and this record of their own shapes (a JSON
# string): what ``python -m shardkit checkpoint`` reshapes such a checkpoint with; load_state_dict ignores it.
SHAPES_KEY = "_shardkit.shapes"


def boxes_of_range(shape: tuple[int, ...], begin: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The elements [begin, end) of a row-major tensor of ``shape`` as the fewest boxes that cover them in order:
    ``(offsets, sizes, first element)`` each. Every box is itself a contiguous range (a part of one row, whole
    rows, ...), so it is a view of the range's memory: at most 2 per dimension past the first, plus one."""
    if begin >= end:
        return []
    if not shape:
        return [((), (), begin)]
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(begin, inner)
    last_row, last_col = divmod(end, inner)
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def within(row: int, lo: int, hi: int) -> None:
        for offsets, sizes, first in boxes_of_range(tuple(shape[1:]), lo, hi):
            out.append(((row, *offsets), (1, *sizes), row * inner + first))

    if first_row == last_row:
        within(first_row, first_col, last_col)
        return out
    if first_col:
        within(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:
        out.append(((first_row, *[0] * (len(shape) - 1)), (last_row - first_row, *shape[1:]), first_row * inner))
    if last_col:
        within(last_row, 0, last_col)
    return out


class PieceTensor(torch.Tensor):
    """This rank's piece of a parameter laid out flat (a range of its row-major elements), shown to
    torch.distributed.checkpoint as the parameter in its own shape of which this rank holds some boxes.

    It is the 1-D piece itself (the same memory: DCP loads into it in place), but ``size()`` / ``shape`` are the
    parameter's, and it answers DCP's checkpointable protocol (``_torch_compat.dcp_*``): the boxes the range covers
    (boxes_of_range) as the chunks to write and to read, each a view of the piece. So a flat layout's checkpoint
    is, to DCP and to every other reader, the same as one of torch FSDP2's dim-0 chunks or of a whole tensor, and
    DCP reshards between any of them. Torch operations on it see the plain 1-D piece (``local``, elements
    ``begin`` .. ``begin + numel`` of the parameter), except a copy into a tensor of another shape, which raises
    (code that stages a state dict by its values' sizes, as ``dcp.async_save``'s stagers do, would otherwise
    broadcast the piece into a whole parameter): save with ``shardkit.checkpoint.save`` or ``dcp.save``.
    ``copy.deepcopy`` and ``torch.save`` keep it a PieceTensor."""

    global_shape: torch.Size
    local: torch.Tensor
    begin: int
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]

    @classmethod
    def of(cls, local: torch.Tensor, shape: torch.Size, begin: int) -> PieceTensor:
        piece = _torch_compat.make_tensor_subclass(cls, local.detach(), False)
        piece.global_shape = torch.Size(shape)
        piece.local = local.detach()
        piece.begin = begin
        piece.boxes = [(offsets, sizes, first - begin)
                       for offsets, sizes, first in boxes_of_range(tuple(shape), begin, begin + local.numel())]
        return piece

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], PieceTensor) \
                and not isinstance(args[0], PieceTensor) and args[0].shape != args[1].local.shape:
            piece = args[1]
            raise TypeError(f"shardkit: a PieceTensor (this rank's {piece.local.numel()} elements, from element "
                            f"{piece.begin} on, of a parameter of shape {list(piece.global_shape)}) cannot be "
                            f"copied into a tensor of shape {list(args[0].shape)}: a sharded state dict of "
                            "shardkit's FSDP1 front or ZeRO saves with shardkit.checkpoint.save or dcp.save (not "
                            "dcp.async_save); piece.local is the piece as a plain tensor")
        with _torch_compat.torch_function_disabled():
            return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"PieceTensor(elements {self.begin}..{self.begin + self.local.numel()} of shape "
                f"{list(self.global_shape)}: {self.local!r})")

    def __deepcopy__(self, memo: dict) -> PieceTensor:
        return PieceTensor.of(self.local.clone(), self.global_shape, self.begin)

    def __reduce_ex__(self, protocol: Any):
        return (_piece_tensor, (self.local, tuple(self.global_shape), self.begin))

    def size(self, dim: int | None = None):
        return self.global_shape if dim is None else self.global_shape[dim]

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self.global_shape

    def box(self, offsets: tuple[int, ...]) -> torch.Tensor:
        """The box at ``offsets``, a view of the piece in the box's shape."""
        for box_offsets, sizes, start in self.boxes:
            if tuple(box_offsets) == tuple(offsets):
                return self.local[start:start + math.prod(sizes)].view(sizes)
        raise ValueError(f"shardkit: no box of this rank's piece starts at {list(offsets)} (its boxes start at "
                         f"{[list(o) for o, _, _ in self.boxes]}; parameter shape {list(self.global_shape)})")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        return [_torch_compat.dcp_shard_write_item(fqn, offsets, sizes, self.global_shape, self.local)
                for offsets, sizes, _ in self.boxes]

    def __create_chunk_list__(self) -> list[Any]:
        return [_torch_compat.dcp_chunk(offsets, sizes) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return _exact(self.box(tuple(index.offset)))


def _piece_tensor(local: torch.Tensor, shape: tuple[int, ...], begin: int) -> PieceTensor:
    """Unpickling (torch.load) a PieceTensor."""
    return PieceTensor.of(local, torch.Size(shape), begin)


def _exact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where it is a part of a larger storage an alias of exactly its bytes (_C.exact_storage_alias,
    the same memory): DCP's writer copies a tensor whose storage is larger than it before writing."""
    if tensor.numel() and tensor.untyped_storage().nbytes() != tensor.nbytes:
        return _C.exact_storage_alias(tensor)
    return tensor


@dataclasses.dataclass(eq=False)
class ShardedSpace:
    """One flat layout's parameters as a checkpoint sees them."""

    layout: Any  # _C.FlatLayout
    names: list[str]  # the parameters' names in the unwrapped model, in layout order
    shapes: list[torch.Size]  # their own shapes
    group: dist.ProcessGroup | None  # the group the shards are spread over; None: every rank holds everything

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def piece(self, index: int):
        return self.layout.piece(index, self.rank)

    def cut(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole value of parameter ``index`` (any shape with its numel): a 1-D view."""
        piece = self.piece(index)
        return whole.reshape(-1)[piece.param_begin:piece.param_begin + piece.numel]

    def piece_tensor(self, index: int, local: torch.Tensor) -> PieceTensor | torch.Tensor:
        """``local`` (this rank's piece, 1-D) as a PieceTensor of the parameter in its own shape; where the space
        is not sharded (every rank holds the whole parameter; DCP saves it once) or the parameter is empty, the
        whole value itself in its own shape."""
        shape = self.shapes[index]
        if self.group is None or self.layout.numels[index] == 0:
            return _exact(local).view(shape)
        return PieceTensor.of(local, shape, self.piece(index).param_begin)

    def gather(self, pieces: list[torch.Tensor | None], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Every parameter's whole value, in its own shape (views of one gathered buffer), from this rank's
        ``pieces`` (one per parameter, its piece's shape or 1-D; None: zeros) and every other rank's: one
        all-gather of the S-element shards (a collective over ``group``: every rank calls it with the same
        dtype). The pieces are packed straight into this rank's slice of the output, which is then the
        all-gather's input (``_flat.packed_output``, as FlatParamHandle's gather does): one unit's worth of
        memory, no staging shard."""
        layout = self.layout
        world = layout.world if self.group is not None else 1
        whole, mine = _flat.packed_output(layout, self.rank, world, pieces, dtype, device)
        if self.group is not None:
            _exchange.all_gather_single(whole, mine, group=self.group)
        return [whole[offset:offset + numel].view(shape)
                for offset, numel, shape in zip(layout.offsets, layout.numels, self.shapes)]


def check_piece(where: str, subject: str, value: PieceTensor, piece: Any) -> None:
    """Raises where ``value`` is not this rank's ``piece`` (a _C.FlatLayout piece) of the same parameter: another
    layout's piece of the same size would land in the wrong place."""
    if (value.begin, value.local.numel()) != (piece.param_begin, piece.numel):
        raise RuntimeError(f"{where}: {subject} holds elements {value.begin}..{value.begin + value.local.numel()} "
                           f"of it, but this rank's piece is elements {piece.param_begin}.."
                           f"{piece.param_begin + piece.numel}: a state dict of another layout; load it through "
                           "DCP (dcp.load or shardkit.checkpoint.load), which reshards")


def check_shape(where: str, subject: str, got: Iterable[int], want: Iterable[int]) -> None:
    """Raises ``"{where}: {subject} has shape [..] in the checkpoint but [..] in the model"`` when they differ
    (``where``: who, on which rank, in which call; ``subject``: the parameter or state it is about)."""
    if torch.Size(got) != torch.Size(want):
        raise RuntimeError(f"{where}: {subject} has shape {list(got)} in the checkpoint but {list(want)} in the model")


# --- model state --------------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Place:
    """Where one parameter of the model state dict lives: its space and index, this rank's piece (a 1-D view of
    the live values), and the whole parameter when this rank holds it whole (ZeRO), else None (FSDP)."""

    space: ShardedSpace
    index: int
    local: torch.Tensor
    whole: torch.Tensor | None = None


def owned_copy(value: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    """A copy of ``value`` (on the CPU when ``offload_to_cpu``) with a storage of its own, exactly its bytes:
    what a full state dict hands out (a view of a flat buffer or an alias of a live tensor would change, or
    point at freed memory, after the next step)."""
    value = value.detach()
    if offload_to_cpu and value.device.type != "cpu":
        return value.to("cpu")  # a new tensor already
    return value.clone(memory_format=torch.contiguous_format)


def sharded_entries(entries: dict[str, Any], places: dict[int, Place], offload_to_cpu: bool) -> dict[str, Any]:
    """A sharded model state dict: each placed parameter as a PieceTensor of its piece, other tensors detached.
    ``entries``: the unwrapped module's state dict with ``keep_vars=True`` (so parameters can be found in
    ``places`` by identity). An OrderedDict, as torch's state dicts are."""
    out: dict[str, Any] = OrderedDict()
    for key, value in entries.items():
        place = places.get(id(value)) if isinstance(value, torch.Tensor) else None
        if place is not None:
            local = place.local.cpu() if offload_to_cpu else place.local
            out[key] = place.space.piece_tensor(place.index, local)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu() if offload_to_cpu else value.detach()
        else:
            out[key] = value
    return out


def load_entries(where: str, entries: dict[str, Any], places: dict[int, Place],
                 state_dict: Mapping[str, Any], strict: bool) -> _torch_compat.IncompatibleKeys:
    """Loads a full or a sharded model state dict (the kind of each value decides) into the live tensors of
    ``entries`` (the unwrapped state dict with keep_vars=True). Each placed parameter gets its piece, or its whole
    value where this rank holds it whole; a PieceTensor value that is the piece itself (DCP loaded into this
    rank's own sharded state dict) is only checked. No communication. Mismatches raise naming the
    parameter and both shapes; missing or unexpected keys raise under ``strict``, naming them."""
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries and not k.endswith(SHAPES_KEY)]
    if strict and (missing or unexpected):
        raise RuntimeError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for key, target in entries.items():
            if key not in state_dict or not isinstance(target, torch.Tensor):
                continue
            value = state_dict[key]
            place = places.get(id(target))
            if place is None:  # a buffer, a frozen or ignored parameter: whole on every rank
                check_shape(where, f"parameter {key!r}", value.shape, target.shape)
                target.copy_(value)
                continue
            numel = place.space.layout.numels[place.index]
            own_shape = place.space.shapes[place.index]
            if isinstance(value, PieceTensor):
                check_shape(where, f"parameter {key!r}", value.size(), own_shape)
                check_piece(where, f"parameter {key!r}", value, place.space.piece(place.index))
                if value.local.data_ptr() != place.local.data_ptr():
                    place.local.copy_(value.local)
                continue
            # a whole parameter: its own shape (a full state dict) or flattened (an unsharded space's sharded one)
            if torch.Size(value.shape) != torch.Size([numel]):
                check_shape(where, f"parameter {key!r}", value.shape, own_shape)
            if place.whole is not None:
                place.whole.copy_(value.reshape(place.whole.shape))
            else:
                place.local.copy_(place.space.cut(place.index, value))
    return _torch_compat.IncompatibleKeys(missing, unexpected)


# --- optimizer state ----------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Slot:
    """One parameter's piece that this rank's optimizer steps: the tensor the optimizer keys its state by (FSDP:
    the sharded parameter; ZeRO: the piece's leaf), and where the piece lies (``space`` None: the parameter is
    outside every flat layout and whole on every rank). ``in_place``: such a whole parameter's state tensors go
    into sharded state dicts as they are, not copied, so that DCP loads into them (a shardkit DDP's plain
    optimizer; DCP saves each value once, in the parameter's shape, the format of every other front's)."""

    name: str
    param: torch.Tensor
    space: ShardedSpace | None = None
    index: int = -1
    in_place: bool = False


def _piece_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """An optimizer that has not stepped holds no state tensors for a checkpoint to be loaded into: one step
    with zero gradients and a zero learning rate creates them without changing a parameter (as torch's
    torch.distributed.checkpoint.state_dict does). No communication (``optim`` is a local optimizer)."""
    if optim.state:
        return
    saved = []
    for group in optim.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optim.step()
    for group, lr in zip(optim.param_groups, saved):
        group["lr"] = lr
    optim.zero_grad(set_to_none=True)


def optim_state_dict(optim: torch.optim.Optimizer, slots: list[Slot], spaces: list[ShardedSpace],
                     groups: list[dict[str, Any]], *, sharded: bool, group: dist.ProcessGroup | None,
                     device: torch.device, keep: bool = True) -> dict[str, Any]:
    """The name-keyed optimizer state dict ``{"state": {name: {key: value}}, "param_groups": groups}``.

    Sharded: each piece-shaped state tensor as ``space.piece_tensor`` (no communication; a rank holds the
    names it has pieces of). Full: every state tensor in its parameter's own shape on every rank, gathered per
    space and state key (a collective over ``group``, whose ranks agree first, in one object exchange, on the
    keys and dtypes and on the scalar state of pieces they do not hold). A rank with ``keep`` False (rank0_only)
    takes part in every gather but drops each result at once, and returns ``{}``. Kept values are views of one
    gathered buffer per space and state key (padding included): no second copy."""
    if sharded:
        state: dict[str, dict[str, Any]] = {}
        for slot in slots:
            entry = optim.state.get(slot.param)
            if entry is not None:
                state[slot.name] = {key: _sharded_value(slot, value) for key, value in entry.items()}
        return {"state": state, "param_groups": groups}
    state = _gathered_state(optim, slots, spaces, group, device, keep)
    return {"state": state, "param_groups": groups} if keep else {}


def _sharded_value(slot: Slot, value: Any) -> Any:
    if not _piece_shaped(value, slot.param):
        return _copy(value)
    if slot.space is not None:
        return slot.space.piece_tensor(slot.index, value.detach().reshape(-1))
    return value.detach() if slot.in_place else _copy(value)


def _gathered_state(optim: torch.optim.Optimizer, slots: list[Slot], spaces: list[ShardedSpace],
                    group: dist.ProcessGroup | None, device: torch.device, keep: bool) -> dict[str, dict[str, Any]]:
    position = {id(space): i for i, space in enumerate(spaces)}
    tensor_keys: list[dict[str, torch.dtype]] = [{} for _ in spaces]  # per space: piece-shaped state keys
    others: dict[str, dict[str, Any]] = {}  # per parameter of a space with state here: its other state
    state: dict[str, dict[str, Any]] = {}
    for slot in slots:
        entry = optim.state.get(slot.param)
        if entry is None:
            continue
        if slot.space is None:  # whole on every rank: nothing to gather
            state[slot.name] = {key: _copy(value) for key, value in entry.items()}
            continue
        mine = others.setdefault(slot.name, {})
        for key, value in entry.items():
            if _piece_shaped(value, slot.param):
                tensor_keys[position[id(slot.space)]][key] = value.dtype
            else:
                mine[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    held_here = (tensor_keys, others)
    everyone = _exchange.all_gather_object(held_here, group) if group is not None else [held_here]
    agreed_keys: list[dict[str, torch.dtype]] = [{} for _ in spaces]
    agreed_others: dict[str, dict[str, Any]] = {}
    for their_keys, their_others in everyone:
        for agreed, theirs in zip(agreed_keys, their_keys):
            for key, dtype in theirs.items():
                agreed.setdefault(key, dtype)
        for name, entry in their_others.items():
            agreed_others.setdefault(name, {}).update({k: v for k, v in entry.items()
                                                       if k not in agreed_others.get(name, {})})
    held_by_space: dict[int, dict[int, Slot]] = {}  # id(space) -> {index: slot with state here}
    for slot in slots:
        if slot.space is not None and slot.param in optim.state:
            held_by_space.setdefault(id(slot.space), {})[slot.index] = slot
    for space, keys in zip(spaces, agreed_keys):
        held = held_by_space.get(id(space), {})
        for key in sorted(keys):  # the same keys, in the same order, on every rank
            pieces = [optim.state[held[i].param].get(key) if i in held else None for i in range(len(space.names))]
            wholes = space.gather(pieces, keys[key], device)
            if keep:
                for name, whole in zip(space.names, wholes):
                    if name in agreed_others:
                        state.setdefault(name, {})[key] = whole
            del wholes  # before the next gather: a rank that keeps nothing holds one at a time
    for name, entry in agreed_others.items():
        state.setdefault(name, {}).update({k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() else v
                                           for k, v in entry.items()})
    return state


def check_param_groups(where: str, saved_groups: list[dict[str, Any]], names: list[list[str]]) -> None:
    """The checkpoint's param groups name the optimizer's parameters, group by group (raises on the first
    difference: another model's checkpoint)."""
    if len(saved_groups) != len(names):
        raise ValueError(f"{where}: the checkpoint has {len(saved_groups)} "
                         f"parameter groups, the optimizer {len(names)}")
    for g, (saved, mine) in enumerate(zip(saved_groups, names)):
        if list(saved["params"]) != list(mine):
            missing = [n for n in mine if n not in saved["params"]]
            unexpected = [n for n in saved["params"] if n not in mine]
            raise ValueError(f"{where}: parameter group {g} differs from the "
                             f"optimizer's: missing {missing}, unexpected {unexpected}"
                             + ("" if missing or unexpected else ", the same names in another order"))


def local_optim_state(where: str, slots: list[Slot], optim_state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per slot (by position in ``slots``), its state cut from a name-keyed optimizer state dict, full or
    sharded, saved at any world size and layout: piece-shaped values are this rank's piece in the slot's shape
    (a copy when cut from a whole value, so the whole is not kept alive; a sharded value's local shard as it
    is); other values as they are."""
    out: dict[int, dict[str, Any]] = {}
    for position, slot in enumerate(slots):
        saved = optim_state["state"].get(slot.name)
        if saved is not None:
            out[position] = {key: _local_value(where, slot, key, value) for key, value in saved.items()}
    return out


def _local_value(where: str, slot: Slot, key: str, value: Any) -> Any:
    if isinstance(value, PieceTensor):
        subject = f"state {key!r} of parameter {slot.name!r}"
        if slot.space is None:
            raise RuntimeError(f"{where}: {subject} is a piece of it (elements {value.begin} on), but this rank "
                               "holds the parameter whole: load a full state dict, or through DCP")
        check_shape(where, subject, value.size(), slot.space.shapes[slot.index])
        check_piece(where, subject, value, slot.space.piece(slot.index))
        # Not copied: DCP loaded it in place, usually into this optimizer's own state (see optim_state_dict);
        # the optimizer's load_state_dict takes it as it is (same dtype and device), as torch's does.
        return value.local.reshape(slot.param.shape)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return _copy(value)
    if slot.space is None:  # whole: its own shape, or flattened
        if value.shape != torch.Size([slot.param.numel()]):
            check_shape(where, f"state {key!r} of parameter {slot.name!r}", value.shape, slot.param.shape)
        return value.detach().reshape(slot.param.shape).clone()
    if value.numel() != slot.space.layout.numels[slot.index]:
        check_shape(where, f"state {key!r} of parameter {slot.name!r}", value.shape, slot.space.shapes[slot.index])
    return slot.space.cut(slot.index, value.detach()).clone().view(slot.param.shape)

"""What shardkit relies on in torch's FSDP2, pinned: each test states one behaviour of the installed torch's
``fully_shard`` that shardkit's code (python/shardkit/fsdp/_fully_shard.py, through python/shardkit/_torch_compat.py)
assumes and nothing else checks, and fails naming the assumption and the code resting on it when a torch release
changes it.

The trace: torch's own ``fully_shard`` (no shardkit code on its path but _torch_compat's accessors) on 2 ranks over
gloo, a root and two block units, two training steps, with recording plug-ins in place of shardkit's
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``, subclasses of the interfaces
``_torch_compat.fsdp2_comm_interfaces`` gives). They record every call FSDP2 makes into them, in order, and, like
shardkit's SharedReduceInput, issue a collective on the unit's shard group inside each reduce-scatter ``allocate``.
A second trace runs one root-only unit (its reduce-scatter is issued by FSDP2's end-of-backward callback).
"""

from __future__ import annotations

import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from shardkit import _torch_compat  # noqa: E402
from support import harness  # noqa: E402
from support.fsdp_cases import Block  # noqa: E402

WORLD = 2
UNITS = ("blocks.0", "blocks.1", "")  # the units' module paths in the root ("" the root)
_AllGather, _ReduceScatter = _torch_compat.fsdp2_comm_interfaces()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class _Trace:
    """The calls FSDP2 makes into the recording plug-ins of one model, in order, as plain data."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.tensors: dict[tuple[str, str], list[torch.Tensor]] = {}  # (unit, op) -> its last allocations
        self.last_task: int | None = None
        self.main_thread = threading.get_ident()

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        event.update(index=len(self.events), task=_torch_compat.current_graph_task(),
                     main_thread=threading.get_ident() == self.main_thread)
        self.events.append(event)
        return event

    def allocated(self, unit: str, op: str, tensor: torch.Tensor, call: bool) -> None:
        kept = self.tensors.setdefault((unit, op), [])
        if call:
            kept.clear()  # the next collective's allocations start a new list
        kept.append(tensor)

    def queue_end_callback(self) -> None:
        """Like shardkit's UnitLedger: at a backward's first reduce-scatter, an end-of-backward callback."""
        task = _torch_compat.current_graph_task()
        if task is not None and task != self.last_task:
            self.last_task = task
            _torch_compat.queue_end_of_backward(lambda: self.record({"op": "end_of_backward", "queued_by": task}))


class _Plugin:
    def __init__(self, trace: _Trace, unit: str, param_group: Any) -> None:
        self.trace, self.unit, self.param_group = trace, unit, param_group
        self.group = _torch_compat.fsdp2_shard_group(param_group)
        self.fresh = True  # the next allocate starts a collective's allocations

    def _event(self, op: str, step: str, **fields: Any) -> dict[str, Any]:
        return self.trace.record({"op": op, "step": step, "unit": self.unit,
                                  "path_seen": _torch_compat.fsdp2_module_path(self.param_group), **fields})

    def _allocate(self, op: str, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(*size, dtype=dtype, device=device)
        self.trace.allocated(self.unit, op, tensor, self.fresh)
        self.fresh = False
        self._event(op, "allocate", size=[int(s) for s in size], dtype=str(dtype), device=str(device),
                    ptr=tensor.data_ptr())
        return tensor

    def _call(self, op: str, args: tuple, kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        """Records a call of the plug-in; returns its arguments by name."""
        bound = dict(zip(names, args), **kwargs)
        output, input = bound["output_tensor"], bound["input_tensor"]
        self.fresh = True
        self._event(op, "call", positional=len(args), keywords=sorted(kwargs), output=output.data_ptr(),
                    input=input.data_ptr(), async_op=bound.get("async_op", "absent"),
                    shard_group=bound["group"] is self.group)
        return bound


class _RecordingAllGather(_Plugin, _AllGather):
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._allocate("all_gather", size, dtype, device)

    def __call__(self, *args: Any, **kwargs: Any):
        bound = self._call("all_gather", args, kwargs, ("output_tensor", "input_tensor", "group", "async_op"))
        return _torch_compat.all_gather_single(bound["output_tensor"], bound["input_tensor"], bound["group"],
                                               bound.get("async_op", False))


class _RecordingReduceScatter(_Plugin, _ReduceScatter):
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self._allocate("reduce_scatter", size, dtype, device)
        # shardkit's SharedReduceInput issues collectives on the shard group here (growing its block, making pages
        # resident): every rank's allocate must come at the same point of its collective sequence. This one says
        # where each rank is: its count of plug-in events so far and the unit.
        mine = torch.tensor([len(self.trace.events), zlib.crc32(self.unit.encode())], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.group.size())]
        dist.all_gather(everyone, mine, group=self.group)
        self.trace.events[-1]["ranks_at"] = [t.tolist() for t in everyone]
        return tensor

    def __call__(self, *args: Any, **kwargs: Any):
        bound = self._call("reduce_scatter", args, kwargs, ("output_tensor", "input_tensor", "group", "op", "async_op"))
        self.trace.queue_end_callback()
        return _torch_compat.reduce_scatter_single(bound["output_tensor"], bound["input_tensor"], bound["op"],
                                                   bound["group"], bound.get("async_op", False))


def _shard(model: nn.Module, units: dict[str, nn.Module], trace: _Trace, mesh: Any) -> dict[str, Any]:
    """torch's fully_shard on each unit (children first), the recording plug-ins in; what
    ``_torch_compat.fsdp2_param_groups`` and its accessors say of each unit."""
    fully_shard = _torch_compat.fsdp2_fully_shard()
    facts = {}
    for path, module in units.items():
        fully_shard(module, mesh=mesh)
        groups = _torch_compat.fsdp2_param_groups(module)
        facts[path] = {"groups": len(groups)}
        if len(groups) == 1:
            (group,) = groups
            module.set_custom_all_gather(_RecordingAllGather(trace, path, group))
            module.set_custom_reduce_scatter(_RecordingReduceScatter(trace, path, group))
            nested = [m for p, m in units.items() if p != path and p.startswith(path)]
            own = [p for p in module.parameters() if not any(p is q for m in nested for q in m.parameters())]
            params = _torch_compat.fsdp2_params(group)
            facts[path].update(
                shard_group=_torch_compat.fsdp2_shard_group(group) is mesh.get_group(0),
                device=str(_torch_compat.fsdp2_device(group)),
                params_are_the_modules=len(params) == len(own) and all(p is q for p, q in zip(params, own)),
                dtensors=all(type(p).__name__ == "DTensor" for p in params))
    return facts


def _gradient_places(trace: _Trace, units: dict[str, nn.Module]) -> dict[str, dict[str, bool]]:
    """Per unit: whether every sharded gradient lies in the unit's last reduce-scatter output, and whether any lies
    in its input."""
    def inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
        start = buffer.data_ptr()
        return start <= t.data_ptr() < start + buffer.numel() * buffer.element_size()

    places = {}
    for path, module in units.items():
        groups = _torch_compat.fsdp2_param_groups(module)
        if len(groups) != 1 or (path, "reduce_scatter") not in trace.tensors:
            continue
        input, output = trace.tensors[(path, "reduce_scatter")]
        grads = [p.grad.to_local() for p in _torch_compat.fsdp2_params(groups[0]) if p.grad is not None]
        places[path] = {"grads": len(grads), "in_output": all(inside(g, output) for g in grads),
                        "in_input": any(inside(g, input) for g in grads)}
    return places


def _trace_fsdp2(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _Net()
    units = {"blocks.0": model.blocks[0], "blocks.1": model.blocks[1], "": model}
    trace = _Trace()
    facts = _shard(model, units, trace, mesh)
    paramless = nn.ReLU()
    facts["(a module without parameters)"] = _shard(paramless, {"": paramless}, _Trace(), mesh)[""]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    places = None
    for step in range(2):
        torch.manual_seed(100 + 10 * step + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        if step == 0:
            places = _gradient_places(trace, units)
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    root_only = _Net()
    root_trace = _Trace()
    _shard(root_only, {"": root_only}, root_trace, mesh)
    root_only(torch.randn(4, 8)).square().mean().backward()
    return {"facts": facts, "events": trace.events, "root_only_events": root_trace.events, "gradients": places}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> list[dict[str, Any]]:
    """Each rank's trace of FSDP2's calls into the plug-ins (one run for every test here)."""
    outcomes = harness.launch(_trace_fsdp2, WORLD, workdir=tmp_path_factory.mktemp("fsdp2"), backend="gloo",
                              timeout=90)
    failed = [o.error or f"rank {o.rank}: exit code {o.exitcode}" for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    return [o.value for o in outcomes]


def _pin(ok: bool, assumption: str, relied_on_by: str, seen: Any) -> None:
    assert ok, (f"torch {torch.__version__}'s FSDP2 no longer does what shardkit assumes: {assumption}. Relied on by "
                f"{relied_on_by}; update it (and python/shardkit/_torch_compat.py). Seen: {seen}")


def _calls(events: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    return [e for e in events if e["op"] == op]


@pytest.mark.timeout(120)
def test_fsdp2_gives_one_parameter_group_per_unit(traces):
    facts = traces[0]["facts"]
    _pin(all(facts[u]["groups"] == 1 for u in UNITS) and facts["(a module without parameters)"]["groups"] == 0,
         "a fully_shard call manages one FSDPParamGroup when its module has parameters, none when it has none "
         "(_torch_compat.fsdp2_param_groups)", "fsdp/_fully_shard.py _plug_in (which plugs in exactly one group)",
         facts)
    _pin(all(facts[u]["shard_group"] and facts[u]["device"] == "cpu" for u in UNITS),
         "a group's mesh_info.shard_process_group is the mesh's group, its device the parameters' "
         "(_torch_compat.fsdp2_shard_group, fsdp2_device)",
         "fsdp/_fully_shard.py _plug_in (zero-copy and identity checks per shard group, for CPU parameters)", facts)
    _pin(all(facts[u]["params_are_the_modules"] and facts[u]["dtensors"] for u in UNITS),
         "a group's fsdp_params[i].sharded_param are the unit's own parameters, DTensors, in registration order "
         "(_torch_compat.fsdp2_params)", "fsdp/_fully_shard.py _Unit (a unit's identity: its parameters' count and "
         "elements)", facts)


@pytest.mark.timeout(120)
def test_fsdp2_names_each_unit_before_its_first_collective(traces):
    for rank, trace in enumerate(traces):
        wrong = [e for e in trace["events"] if e["op"] != "end_of_backward" and e["path_seen"] != e["unit"]]
        _pin(not wrong, "a unit's module path in the root (FSDPParamGroup._module_fqn) is set at the root's first "
             "forward, before any collective of any unit (_torch_compat.fsdp2_module_path)",
             "fsdp/_fully_shard.py _Unit.identity_scope (each collective carries its unit's path)",
             f"rank {rank}: {wrong[:3]}")


@pytest.mark.timeout(120)
def test_fsdp2_all_gather_allocates_its_output_then_gathers_into_it(traces):
    for rank, trace in enumerate(traces):
        events = _calls(trace["events"], "all_gather")
        pairs = [events[i:i + 2] for i in range(0, len(events), 2)]
        bad = [p for p in pairs if len(p) != 2 or [e["step"] for e in p] != ["allocate", "call"]
               or p[0]["unit"] != p[1]["unit"] or p[1]["output"] != p[0]["ptr"] or p[1]["positional"]
               or p[1]["keywords"] != ["async_op", "group", "input_tensor", "output_tensor"]]
        _pin(events and not bad, "each all-gather calls AllGather.allocate once (its output) and then the plug-in "
             "once, by keywords output_tensor (that buffer), input_tensor, group, async_op",
             "fsdp/_fully_shard.py UnitAllGather (allocate, __call__ under the unit's identity)",
             f"rank {rank}: {bad[:2] or events[:2]}")


@pytest.mark.timeout(120)
def test_fsdp2_reduce_scatter_asks_for_its_input_then_its_output_then_reduces(traces):
    for rank, trace in enumerate(traces):
        for name in ("events", "root_only_events"):
            events = _calls(trace[name], "reduce_scatter")
            triples = [events[i:i + 3] for i in range(0, len(events), 3)]
            bad = [t for t in triples if len(t) != 3 or [e["step"] for e in t] != ["allocate", "allocate", "call"]
                   or len({e["unit"] for e in t}) != 1 or t[0]["size"] != [t[1]["size"][0] * WORLD]
                   or t[2]["input"] != t[0]["ptr"] or t[2]["output"] != t[1]["ptr"]
                   or t[2]["async_op"] not in ("absent", False) or t[2]["positional"]
                   or t[2]["keywords"] != ["group", "input_tensor", "op", "output_tensor"]]
            _pin(events and not bad, "each reduce-scatter calls ReduceScatter.allocate for its input (world size x "
                 "the output), then for its output, then the plug-in synchronously (no async_op) by keywords with "
                 "exactly those two buffers, and no other reduce-scatter of the group allocates in between",
                 "fsdp/_fully_shard.py SharedReduceInput.lend / taken_by (the shared block is lent to the first "
                 "allocate of a reduce-scatter only, and back at its call; otherwise it retires for good)",
                 f"rank {rank} ({name}): {bad[:1] or events[:3]}")


@pytest.mark.timeout(120)
def test_fsdp2_keeps_the_sharded_gradients_in_the_reduce_scatter_output(traces):
    for rank, trace in enumerate(traces):
        places = trace["gradients"]
        _pin(set(places) == set(UNITS) and all(p["grads"] and p["in_output"] and not p["in_input"]
                                               for p in places.values()),
             "the sharded gradients are views of the reduce-scatter's output (its second allocation), none of its "
             "input, which FSDP2 does not keep", "fsdp/_fully_shard.py SharedReduceInput (only the input is lent "
             "the shared block, which the next reduce-scatter reuses)", f"rank {rank}: {places}")


@pytest.mark.timeout(120)
def test_fsdp2_calls_the_plugins_at_the_same_points_on_every_rank(traces):
    def sequence(trace, name):
        return [(e["op"], e.get("step"), e.get("unit"), e.get("size")) for e in trace[name]]

    for name in ("events", "root_only_events"):
        _pin(all(sequence(t, name) == sequence(traces[0], name) for t in traces),
             "every rank makes the same calls into the plug-ins in the same order",
             "fsdp/_fully_shard.py SharedReduceInput and UnitLedger (collectives issued in allocate; identities "
             "compared in issue order)", [sequence(t, name)[:6] for t in traces])
        inside = [e for t in traces for e in _calls(t[name], "reduce_scatter") if e["step"] == "allocate"]
        misplaced = [e for e in inside if len({tuple(at) for at in e["ranks_at"]}) != 1]
        _pin(inside and not misplaced, "a collective issued inside ReduceScatter.allocate pairs with the same "
             "allocate on every rank of the shard group", "fsdp/_fully_shard.py SharedReduceInput.lend "
             "(shared_buffer and ResidentSharedMemory.ensure are collectives on the group)", misplaced[:2])
        elsewhere = [e for t in traces for e in t[name] if not e["main_thread"]]
        _pin(not elsewhere, "FSDP2 calls the plug-ins on the thread that runs forward and backward",
             "fsdp/_fully_shard.py SharedReduceInput and UnitLedger (their state is not locked)", elsewhere[:2])


@pytest.mark.timeout(120)
def test_fsdp2_reduce_scatters_inside_the_backward_before_its_end_callback(traces):
    for rank, trace in enumerate(traces):
        for name in ("events", "root_only_events"):
            events = trace[name]
            calls = [e for e in _calls(events, "reduce_scatter") if e["step"] == "call"]
            ends = _calls(events, "end_of_backward")
            late = [c for c in calls if c["task"] is None or not any(
                e["queued_by"] == c["task"] and e["index"] > c["index"] for e in ends)]
            _pin(calls and not late, "every reduce-scatter runs inside the backward pass (a graph task), and an "
                 "end-of-backward callback queued at a backward's first reduce-scatter runs after its last one, "
                 "also where FSDP2's own end-of-backward callback issues it",
                 "fsdp/_fully_shard.py UnitLedger.record (the ledger's check, queued there, must see every "
                 "collective of the backward)", f"rank {rank} ({name}): {late[:2]}")


@pytest.mark.timeout(120)
def test_fsdp2_runs_each_units_collectives_on_its_shard_group(traces):
    for rank, trace in enumerate(traces):
        calls = [e for e in trace["events"] if e.get("step") == "call"]
        _pin(calls and all(e["shard_group"] for e in calls), "FSDP2 passes the plug-ins the unit's shard group "
             "(with no set_separate_reduce_scatter_group)", "fsdp/_fully_shard.py UnitReduceScatter (a call on "
             "another group retires the shared block, made for the shard group)",
             f"rank {rank}: {[e for e in calls if not e['shard_group']][:2]}")

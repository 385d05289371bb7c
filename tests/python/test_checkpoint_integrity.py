"""Checkpoints with a commit point and checksums (issue #25): shardkit.checkpoint.save / load / verify.

What each test can catch:
- a rank killed during a save (while writing, before and after the commit's rename) that leaves a torn or mixed
  checkpoint where the previous one was, survivors that hang instead of raising, leftovers that stay, a next
  save that cannot run;
- a full disk that reports "unexpected pos" instead of "No space left on device", or that costs the previous
  checkpoint;
- bit flips (at the start, 10 %, the middle and the last byte of a data file, in .metadata, in the manifest),
  a file truncated at half (with and without a manifest) and a data file of another save that load accepts, or
  refuses on some ranks only, or without naming the file; ``info --verify`` and ``verify`` that miss them;
- a plain dcp.save checkpoint that no longer loads (or loads without the warning), a shardkit checkpoint that
  plain dcp.load cannot read. (The README's Checkpoints section, now the Checkpointer loop: test_resume.py.)

Values are compared bit for bit (every tensor's bytes) with what was saved.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from support.cli import shardkit_here
from support.ddp_cases import error_of
from support.fsdp_cases import adamw, block_policy, net, train_global

MANIFEST = ".shardkit-manifest.json"


# --- the model, its state and its exact values -------------------------------------------------------------------

def _trained(rank: int, world: int, steps: int, seed: int = 0):
    import shardkit

    model = shardkit.FullyShardedDataParallel(net(seed=seed, depth=2, d_in=7), auto_wrap_policy=block_policy())
    optimizer = adamw(model.parameters())
    train_global(model, optimizer, rank, world, range(steps))
    return model, optimizer


def _state(model, optimizer) -> dict:
    from shardkit.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _bits(model, optimizer) -> dict[str, bytes]:
    """Every parameter's and optimizer state tensor's full value, as bytes (a collective: gathered)."""
    from shardkit.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    values = {f"model.{k}": v for k, v in model_sd.items()}
    values.update({f"optim.{name}.{k}": v for name, entry in optim_sd["state"].items() for k, v in entry.items()})
    return {k: bytes(v.detach().reshape(-1).view(torch.uint8).tolist()) for k, v in values.items()}


def _loaded_bits(path: str, load) -> dict[str, bytes]:
    """A model built from other values, loaded from ``path`` through ``load(state, path)``: its values."""
    from shardkit.state_dict import set_state_dict

    model, optimizer = _trained(0, 1, steps=0, seed=123)  # no step: other values, no optimizer state yet
    state = _state(model, optimizer)
    load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _bits(model, optimizer)


def _shardkit_load(state: dict, path: str) -> None:
    from shardkit import checkpoint

    checkpoint.load(state, path)


def _plain_dcp_load(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path)


def _save_trained(rank: int, world: int, path: str, steps: int) -> dict[str, bytes]:
    from shardkit import checkpoint

    model, optimizer = _trained(rank, world, steps)
    checkpoint.save(_state(model, optimizer), path)
    return _bits(model, optimizer)


def _others_in(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != name)


# --- a rank killed in the middle of a save -----------------------------------------------------------------------

def _kill_this_rank() -> None:
    import os

    os.kill(os.getpid(), signal.SIGKILL)


def _save_and_die(rank: int, world: int, path: str, steps: int, victim: int, point: str) -> None:
    """Saves like _save_trained, but rank ``victim`` is SIGKILLed at ``point``: 'write' (right after DCP wrote
    its first item into its data file), 'publish' (rank 0, manifest written, before the rename that commits),
    'retire' (rank 0, right after that rename, before the replaced checkpoint is removed)."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from shardkit import checkpoint
    from shardkit.checkpoint import _commit

    model, optimizer = _trained(rank, world, steps)
    state = _state(model, optimizer)
    if rank == victim and point == "write":
        write_item = dcp_filesystem._write_item

        def write_then_die(*args, **kwargs):
            write_item(*args, **kwargs)
            _kill_this_rank()

        dcp_filesystem._write_item = write_then_die
    if rank == victim and point in ("publish", "retire"):
        publish = _commit.publish

        def die_around_publish(*args, **kwargs):
            if point == "retire":
                publish(*args, **kwargs)
            _kill_this_rank()

        _commit.publish = die_around_publish
    checkpoint.save(state, path)


def _recover(rank: int, world: int, path: str, new_steps: int) -> dict:
    """After a killed save: what loads now; then a save of the state after ``new_steps`` steps and what loads."""
    loaded = _loaded_bits(path, _shardkit_load)
    saved = _save_trained(rank, world, path, new_steps)
    return {"loaded": loaded, "saved": saved, "reloaded": _loaded_bits(path, _shardkit_load)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, victim, point", [(2, 1, "write"), (2, 0, "publish"), (2, 0, "retire"),
                                                  (4, 2, "write")])
def test_a_rank_killed_during_a_save_leaves_a_whole_checkpoint(ranks, tmp_path: Path, world, victim, point):
    parent = tmp_path / "checkpoints"
    path = str(parent / "ckpt")
    old = ranks.run(_save_trained, world, path, 2, timeout=120)[0]
    outcomes = ranks.launch(_save_and_die, world, path, 4, victim, point, timeout=120, pg_timeout=30)
    for outcome in outcomes:
        if outcome.rank == victim:
            assert outcome.exitcode == -signal.SIGKILL and not outcome.finished, outcome
            continue
        assert outcome.finished and outcome.error is not None, f"rank {outcome.rank} did not raise: {outcome}"
        assert "CheckpointSaveError" in outcome.error, outcome.error
        if point == "write":  # the others know nothing was committed
            assert "nothing was committed: the previous checkpoint there, if any, is intact" in outcome.error, \
                outcome.error
        else:  # rank 0 died around the commit: either checkpoint may be there, never a mix
            assert f"could not learn whether rank 0 committed {path}" in outcome.error, outcome.error
    if victim != 0:  # rank 0 lived: it removed the staging directory
        assert _others_in(parent, "ckpt") == [], _others_in(parent, "ckpt")
    result = ranks.run(_recover, world, path, 4, timeout=120)
    new = result[0]["saved"]
    assert old != new
    committed = new if point == "retire" else old  # after the rename the new checkpoint is the checkpoint
    for rank, got in enumerate(result):
        assert got["loaded"] == committed, f"rank {rank}: the checkpoint after the kill is not the committed one"
        assert got["saved"] == new and got["reloaded"] == new, f"rank {rank}: the next save did not round-trip"
    assert _others_in(parent, "ckpt") == [], "the next save left leftovers"


# --- a full disk ---------------------------------------------------------------------------------------------------

@pytest.mark.timeout(200)
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path):
    """Two ranks in a mount namespace where the checkpoint directory's parent is a 9 MB tmpfs: the first save
    (~6.3 MB) fits, the second (staged beside it) does not."""
    from support.hostbed import UNSHARE, namespaces_unavailable, run_in_session

    why = namespaces_unavailable()
    if why:
        pytest.skip(f"no mount namespace for a small tmpfs: {why}")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = Path(__file__).parent / "support" / "checkpoint_disk_full_script.py"
    shell = 'mount -t tmpfs -o size=9m shardkit-disk "$1" && shift && exec "$@"'
    result = run_in_session([*UNSHARE, "sh", "-c", shell, "sh", str(disk), sys.executable, str(script), str(disk)],
                  timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [__import__("json").loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1], result.stdout + result.stderr[-3000:]
    for r in lines:
        error = r["error"]
        assert error is not None, f"rank {r['rank']}: the save over a full disk succeeded"
        assert error.startswith(f"shardkit checkpoint save (rank {r['rank']}): saving {disk}/ckpt failed "
                                "(No space left on device) and nothing was committed: the previous checkpoint "
                                "there, if any, is intact."), error
        # the file that did not fit, named with the cause
        assert re.search(r"writing \S+/__[01]_0\.distcp: \[Errno 28\] No space left on device", error), error
        assert "unexpected pos" not in error, error
        assert r["first_loaded"] and r["tensors"] > 0, r
        assert r["left"] == ["ckpt"], r  # the staging directory was removed


# --- damaged checkpoints -------------------------------------------------------------------------------------------

def _save_three(rank: int, world: int, root: str) -> dict:
    """shardkit saves after 2 and after 3 steps, and a plain dcp.save after 2."""
    import torch.distributed.checkpoint as dcp

    two = _save_trained(rank, world, f"{root}/two", 2)
    three = _save_trained(rank, world, f"{root}/three", 3)
    model, optimizer = _trained(rank, world, 2)
    dcp.save(_state(model, optimizer), checkpoint_id=f"{root}/plain")
    return {"two": two, "three": three}


def _flip(path: Path, offset: int, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    offset = min(offset, len(data) - 1)
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _damaged_copies(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (damaged checkpoint directory, the file load must name)."""
    cases: dict[str, tuple[Path, str]] = {}

    def copy(name: str, source: str = "two") -> Path:
        target = root / "damaged" / name
        shutil.copytree(root / source, target)
        return target

    size = (root / "two" / "__1_0.distcp").stat().st_size
    for label, offset in (("start", 0), ("10%", size // 10), ("middle", size // 2), ("last byte", size - 1)):
        directory = copy(f"flip at {label}".replace(" ", "_").replace("%", "pc"))
        _flip(directory / "__1_0.distcp", offset, count=1 if label == "last byte" else 16)
        cases[f"flip at {label}"] = (directory, "__1_0.distcp")
    directory = copy("flip_metadata")
    _flip(directory / ".metadata", (directory / ".metadata").stat().st_size // 2)
    cases["flip in .metadata"] = (directory, ".metadata")
    directory = copy("flip_manifest")
    text = (directory / MANIFEST).read_text()
    (directory / MANIFEST).write_text(text.replace('"size": ', '"size": 1', 1))
    cases["edited manifest"] = (directory, MANIFEST)
    directory = copy("truncated")
    _truncate_half(directory / "__0_0.distcp")
    cases["truncated"] = (directory, "__0_0.distcp")
    directory = copy("mixed")
    shutil.copy(root / "three" / "__1_0.distcp", directory / "__1_0.distcp")  # rank 1's file of the other save
    cases["mixed"] = (directory, "__1_0.distcp")
    directory = copy("plain_truncated", source="plain")
    _truncate_half(directory / "__0_0.distcp")
    cases["truncated, no manifest"] = (directory, "__0_0.distcp")
    return cases


def _load_all(rank: int, world: int, cases: dict[str, tuple[str, str]], root: str) -> dict:
    from shardkit import checkpoint

    errors = {}
    for name, (directory, _) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", checkpoint.UnverifiedCheckpointWarning)
            errors[name] = error_of(lambda: _loaded_bits(directory, _shardkit_load),
                                    checkpoint.CheckpointIntegrityError, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = _loaded_bits(f"{root}/plain", _shardkit_load)
    unverified = [str(w.message) for w in caught if issubclass(w.category, checkpoint.UnverifiedCheckpointWarning)]
    from shardkit.checkpoint import _verify

    checked: list[str] = []
    check_file = _verify._check_file

    def recording(directory, name, *args, **kwargs):
        checked.append(name)
        return check_file(directory, name, *args, **kwargs)

    _verify._check_file = recording
    through_shardkit = _loaded_bits(f"{root}/two", _shardkit_load)
    _verify._check_file = check_file
    return {"errors": errors, "plain": plain, "unverified": unverified, "checked": checked,
            "through_dcp": _loaded_bits(f"{root}/two", _plain_dcp_load), "through_shardkit": through_shardkit}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", "checkpoint", *args], capture_output=True, text=True,
                          timeout=120)


def _cli_here(*args: str) -> subprocess.CompletedProcess:
    """The same command line run by ``python -m shardkit``'s main in this process: its exit code, stdout and stderr
    (a process per damaged copy would import torch again each time for the same code path)."""
    return shardkit_here("checkpoint", *args)


@pytest.mark.timeout(300)
def test_damaged_checkpoints_are_refused_on_every_rank_naming_the_file(ranks, tmp_path: Path):
    from shardkit import checkpoint

    saved = ranks.run(_save_three, 2, str(tmp_path), timeout=120)[0]
    cases = _damaged_copies(tmp_path)
    checked: list[list[str]] = []
    plain_cases = {name: (str(d), f) for name, (d, f) in cases.items()}
    for world in (2, 3):  # at 3, more ranks than files: one rank verifies nothing, all raise alike
        chosen = plain_cases if world == 2 else {k: plain_cases[k] for k in ("flip at middle", "mixed")}
        for rank, got in enumerate(ranks.run(_load_all, world, chosen, str(tmp_path), timeout=150)):
            for name, (directory, victim) in chosen.items():
                error = got["errors"][name]
                where = f"world {world}, rank {rank}, {name}"
                assert error.startswith(f"shardkit checkpoint load (rank {rank}): {directory} failed verification, "
                                        "nothing was loaded: "), f"{where}: {error}"
                assert f"{directory}/{victim}: " in error, f"{where}: {error}"
            if world == 2:
                errors = got["errors"]
                assert "CRC32C" in errors["flip at 10%"] and "bit flips, or a file of another save" in errors["mixed"]
                assert re.search(r"__0_0\.distcp: \d+ bytes, but save \w+ \(rank 0\) wrote \d+ \(truncated\)",
                                 errors["truncated"]), errors["truncated"]
                assert re.search(r"__0_0\.distcp: \d+ bytes, but \.metadata places data up to byte \d+ in it "
                                 r"\(truncated\)", errors["truncated, no manifest"]), errors["truncated, no manifest"]
                assert "unreadable shardkit manifest" in errors["edited manifest"], errors["edited manifest"]
            assert got["plain"] == saved["two"], f"world {world}, rank {rank}: the plain dcp.save checkpoint"
            assert len(got["unverified"]) == 1 and "has no shardkit manifest" in got["unverified"][0], got["unverified"]
            assert got["through_dcp"] == saved["two"], f"world {world}, rank {rank}: plain dcp.load of shardkit's"
            assert got["through_shardkit"] == saved["two"], f"world {world}, rank {rank}"
            if world == 2:  # every file verified, each by one rank (the world-3 launch loads it too)
                checked.append(got["checked"])
    assert sorted(name for names in checked for name in names) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert saved["two"] != saved["three"]
    # The command line and verify() in this process, without a process group. A real `python -m shardkit` runs
    # for the deliberate failure ("flip at middle": exit code 1) and "plain" (its warning on the real stderr).
    good = _cli_here("info", "--verify", str(tmp_path / "two"))
    assert good.returncode == 0, good.stderr
    assert re.search(r"^verified: 3 files, \d+ bytes, each file's size and CRC32C as written$", good.stdout, re.M), \
        good.stdout
    assert checkpoint.verify(tmp_path / "two")["checksums"] is True
    for name, (directory, victim) in cases.items():  # one damaged copy through a real command line, all in-process
        bad = (_cli if name == "flip at middle" else _cli_here)("info", "--verify", str(directory))
        assert bad.returncode == 1, f"{name}: {bad.stdout}"
        assert f"{directory}/{victim}: " in bad.stderr, f"{name}: {bad.stderr}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", checkpoint.UnverifiedCheckpointWarning)
            with pytest.raises(checkpoint.CheckpointIntegrityError, match=re.escape(f"{directory}/{victim}: ")):
                checkpoint.verify(directory)
    plain = _cli("info", "--verify", str(tmp_path / "plain"))
    assert plain.returncode == 0 and "has no shardkit manifest" in plain.stderr, plain.stderr
    assert "verified: 3 files" in plain.stdout and "(no checksums to compare)" in plain.stdout, plain.stdout


def test_files_are_split_over_the_ranks_largest_first_each_once():
    from shardkit.checkpoint._manifest import FileRecord
    from shardkit.checkpoint._verify import assign

    files = {name: FileRecord(size=size, crc32c=0, rank=0)
             for name, size in ((".metadata", 10), ("__0_0.distcp", 500), ("__1_0.distcp", 400),
                                ("__2_0.distcp", 300), ("__3_0.distcp", 200))}
    assert assign(files, 2) == [["__0_0.distcp", "__3_0.distcp", ".metadata"], ["__1_0.distcp", "__2_0.distcp"]]
    assert assign(files, 7) == [["__0_0.distcp"], ["__1_0.distcp"], ["__2_0.distcp"], ["__3_0.distcp"],
                                [".metadata"], [], []]
    assert assign(files, 1) == [["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", ".metadata"]]


# --- one process, no process group; the publish where a filesystem cannot exchange -----------------------------------

def test_one_process_saves_and_loads_without_a_process_group(tmp_path: Path):
    from shardkit import checkpoint

    path = tmp_path / "ckpt"
    state = {"w": torch.arange(10, dtype=torch.float32), "step": 3}
    checkpoint.save(state, path)
    checkpoint.save({**state, "w": state["w"] * 2}, path)  # over the first one
    loaded = {"w": torch.zeros(10), "step": 0}
    checkpoint.load(loaded, path)
    assert torch.equal(loaded["w"], state["w"] * 2) and loaded["step"] == 3
    assert checkpoint.verify(path)["world_size"] == 1
    assert _others_in(tmp_path, "ckpt") == []
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep me")
    with pytest.raises(checkpoint.CheckpointSaveError, match="holds files but no checkpoint"):
        checkpoint.save(state, unrelated)
    assert (unrelated / "todo.txt").read_text() == "keep me"
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        checkpoint.load(loaded, tmp_path / "absent")


# --- a checkpoint that would run code when read: refused, nothing of it run ----------------------------------------

class _WritesMarker:
    """What plain pickle turns into a call of ``open(marker, "w")``: the file ``marker`` appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _TrustedNote:
    """A class of the user's own, in a checkpoint's non-tensor value: weights_only reads it once allowed."""

    def __init__(self, text: str) -> None:
        self.text = text


def _with_metadata_carrying(path: Path, payload, manifest: bool) -> None:
    """Rewrites ``path``'s .metadata as its own metadata with ``payload`` inside (planner_data), with a manifest
    recording the new bytes (a consistent forgery, so the checksums pass) or none."""
    import dataclasses
    import pickle

    from shardkit import _C, checkpoint
    from shardkit.checkpoint._manifest import read_manifest, write_manifest

    metadata = checkpoint.read_metadata(path)
    metadata.planner_data = {"w": ("w",), "payload": payload}
    raw = pickle.dumps(metadata)
    (path / ".metadata").write_bytes(raw)
    recorded = read_manifest(path)
    if manifest:
        record = dataclasses.replace(recorded.files[".metadata"], size=len(raw), crc32c=_C.crc32c(raw))
        write_manifest(path, dataclasses.replace(recorded, files={**recorded.files, ".metadata": record}))
    else:
        (path / MANIFEST).unlink()


@pytest.mark.parametrize("manifest", [True, False], ids=["forged manifest", "no manifest"])
def test_a_metadata_pickle_naming_other_globals_is_refused_and_never_run(tmp_path: Path, manifest: bool):
    import pickle

    from shardkit import checkpoint

    live = tmp_path / "plain pickle ran it"
    assert pickle.loads(pickle.dumps(_WritesMarker(live))) and live.exists()  # the payload is live
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.arange(4.0), "step": 3}, path)
    _with_metadata_carrying(path, _WritesMarker(marker), manifest)
    refusal = (f"{path}/.metadata: shardkit refuses to unpickle io.open: a checkpoint's .metadata holds only DCP's "
               "metadata classes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.UnverifiedCheckpointWarning)
        with pytest.raises(checkpoint.CheckpointIntegrityError, match=re.escape(f"failed verification: {refusal}")):
            checkpoint.verify(path)
        with pytest.raises(checkpoint.CheckpointIntegrityError,
                           match=re.escape(f"failed verification, nothing was loaded: {refusal}")):
            checkpoint.load({"w": torch.zeros(4), "step": 0}, path)
        for strict in (True, False):  # sizes only: with a manifest, the strict check's read, then DCP's own
            with pytest.raises(checkpoint.CheckpointIntegrityError) as refused:
                checkpoint.load({"w": torch.zeros(4), "step": 0}, path, verify=False, strict=strict)
            if manifest:
                assert isinstance(refused.value, checkpoint.UnsafeCheckpointError) and str(refused.value) == refusal
            else:  # the size check reads .metadata
                assert str(refused.value).endswith(f"failed verification, nothing was loaded: {refusal}")
    for read in (checkpoint.info, lambda p: checkpoint.consolidate(p, tmp_path / "out.pt")):
        with pytest.raises(checkpoint.UnsafeCheckpointError) as refused:
            read(path)
        assert str(refused.value) == refusal
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_a_value_weights_only_refuses_is_refused_by_key_and_never_run(tmp_path: Path):
    from shardkit import checkpoint

    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.arange(4.0), "extra": {"step": _WritesMarker(marker)}}, path)
    refusal = re.compile(  # between the parentheses, weights_only's own words (torch's wording, by version)
        re.escape(f"checkpoint {path}: shardkit refuses to load 'extra.step': torch.load(weights_only=True) cannot "
                  "read it (UnpicklingError: ") + r"[^()\n]*GLOBAL io\.open[^()\n]*" + re.escape(
                  "); a checkpoint's non-tensor values may hold only what weights_only reads "
                  "(torch.serialization.add_safe_globals adds a class you trust)"))
    for strict in (True, False):
        with pytest.raises(checkpoint.UnsafeCheckpointError) as refused:
            checkpoint.load({"w": torch.zeros(4), "extra": {"step": 0}}, path, strict=strict)
        assert refusal.fullmatch(str(refused.value)), str(refused.value)
    with pytest.raises(checkpoint.UnsafeCheckpointError) as refused:
        checkpoint.consolidate(path, tmp_path / "out.pt")
    assert refusal.fullmatch(str(refused.value)), str(refused.value)
    assert checkpoint.verify(path)["checksums"] and checkpoint.info(path)["tensors"] == 1  # they read no value
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_ordinary_values_and_optimizer_state_round_trip_bitwise(tmp_path: Path):
    from shardkit import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    values = {"step": 7, "lr": 0.25, "name": "run-1", "mixed": [1, 2.5, "a", None, True], "pair": (1, 2),
              "nested": {"a": {"b": [3, 4]}}, "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
              "note": _TrustedNote("mine")}
    tensors = {"bf16": torch.randn(4).to(torch.bfloat16), "ints": torch.arange(6).view(2, 3),
               "flags": torch.tensor([True, False])}
    path = tmp_path / "ckpt"
    checkpoint.save({"model": model.state_dict(), "optim": optimizer.state_dict(), **values, **tensors}, path)

    def blank(tree):  # the same structure, every tensor zeroed and every other value None (optimizer options too)
        if isinstance(tree, dict):
            return {k: blank(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [blank(v) for v in tree]
        return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else None

    state = {"model": blank(model.state_dict()), "optim": blank(optimizer.state_dict()), **blank(values),
             **blank(tensors)}
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refuses to load 'note'.*_TrustedNote"):
        checkpoint.load(state, path)
    with torch.serialization.safe_globals([_TrustedNote]):  # torch's own way to allow a class one trusts
        checkpoint.load(state, path)
    note = state.pop("note")
    assert isinstance(note, _TrustedNote) and note.text == "mine"
    assert {k: state[k] for k in values if k != "note"} == {k: v for k, v in values.items() if k != "note"}
    assert type(state["pair"]) is tuple and state["dtype"] is torch.bfloat16 and type(state["size"]) is torch.Size

    def bits(tree) -> list:
        flat = []
        for key, value in sorted(tree.items(), key=lambda item: str(item[0])) if isinstance(tree, dict) else \
                enumerate(tree):
            if isinstance(value, torch.Tensor):
                flat.append((key, value.dtype, bytes(value.reshape(-1).view(torch.uint8).tolist())))
            elif isinstance(value, (dict, list)):
                flat.append((key, bits(value)))
            else:
                flat.append((key, value))
        return flat

    assert bits(state["model"]) == bits(model.state_dict())
    assert bits(state["optim"]) == bits(optimizer.state_dict())
    assert bits({k: state[k] for k in tensors}) == bits(tensors)


def test_where_directories_cannot_be_exchanged_two_renames_publish_and_a_crash_between_them_is_recovered(
        tmp_path: Path, monkeypatch):
    import errno

    from shardkit import checkpoint
    from shardkit.checkpoint import _commit

    monkeypatch.setattr(_commit._C, "rename_exchange", lambda a, b: errno.EINVAL)  # as on NFS
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.ones(4)}, path)
    checkpoint.save({"w": torch.full((4,), 2.0)}, path)
    loaded = {"w": torch.zeros(4)}
    checkpoint.load(loaded, path)
    assert loaded["w"].tolist() == [2.0] * 4 and _others_in(tmp_path, "ckpt") == []

    # A crash right after the first rename: no checkpoint under its name, the previous one aside.
    real_rename = _commit.os.rename

    def rename_or_crash(src, dst):
        if Path(dst) == path:  # the staging directory's rename into place
            raise SystemExit("killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(_commit.os, "rename", rename_or_crash)
    with pytest.raises(SystemExit):
        checkpoint.save({"w": torch.full((4,), 3.0)}, path)
    monkeypatch.setattr(_commit.os, "rename", real_rename)
    assert not path.exists()
    aside = r"an interrupted save left the previous checkpoint at \S+shardkit-old-"
    with pytest.raises(FileNotFoundError, match=aside):
        checkpoint.load(loaded, path)
    with pytest.warns(UserWarning, match="renamed it back"):
        checkpoint.save({"w": torch.full((4,), 4.0)}, path)  # brings the previous one back, then replaces it
    checkpoint.load(loaded, path)
    assert loaded["w"].tolist() == [4.0] * 4 and _others_in(tmp_path, "ckpt") == []


# --- strict: a mismatch on some ranks only stops every rank -------------------------------------------------------
def _one_rank_asks_for_more(rank: int, world: int, path: str) -> str:
    from shardkit import checkpoint

    checkpoint.save({"model": {"w": torch.full((4,), float(rank))}}, path)
    state = {"model": {"w": torch.zeros(4)}}
    if rank == 1:
        state["model"]["extra"] = torch.zeros(2)  # only rank 1's state dict does not match
    return error_of(lambda: checkpoint.load(state, path), RuntimeError, rank)


@pytest.mark.timeout(60)
def test_a_state_dict_that_does_not_match_on_one_rank_stops_every_rank(ranks, tmp_path: Path):
    path = str(tmp_path / "ckpt")
    errors = ranks.run(_one_rank_asks_for_more, 2, path, timeout=50)  # rank 0 would wait in dcp.load: a hang
    assert errors[1] == (f"shardkit checkpoint load (rank 1): {path} does not match the state dict: missing from "
                         "the checkpoint: ['model.extra']"), errors[1]
    assert errors[0] == (f"shardkit checkpoint load (rank 0): {path} does not match the state dict: rank 1's state "
                         "dict does not: missing from the checkpoint: ['model.extra']"), errors[0]

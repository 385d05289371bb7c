"""shardkit under Lightning (tests/python/support/lightning_script.py under torchrun, 2 ranks unless said).

- Lightning as it is: ``DDPStrategy(process_group_backend="shardkit")`` trains exactly as the same script on gloo,
  on one host and on two simulated hosts; every rank ends with the same weights, on shardkit's process group.
- ``ShardkitStrategy`` (python/shardkit/integrations/lightning.py), every strategy against Lightning's own
  ``DDPStrategy`` on gloo (the anchor: same model, data, seed, AdamW with a step LR schedule, clipping by norm at
  0.05, 2 epochs of 4 steps): the LightningModule's weights after fit are the anchor's (bitwise where the
  reduction order is the same: ddp; else rtol 1e-5: ZeRO and fully_shard clip from shards). The clipping is
  active (the anchor without it ends elsewhere), so parity covers the global norm; ``accumulate_grad_batches=2``
  too; ``auto`` chooses ddp in a budget that holds DDP's model states and fully_shard in one that holds only
  ZeRO-3's.
- ``trainer.save_checkpoint`` after epoch 1 at 2 ranks, ``fit(ckpt_path=...)`` at 3: ends where the uninterrupted
  2-rank run ended (zero2, fully_shard).
- Lightning's ``AsyncCheckpointIO`` with the strategy (ddp, zero2, fully_shard): a training step runs while a save is
  in flight, the file holds bitwise the state of its step, and ``fit(ckpt_path=...)`` from it ends where the
  uninterrupted run ended (bitwise).
- zero2 and fully_shard on two simulated hosts (the hierarchical engine).
- Evaluation (``validate`` / ``test`` / ``predict``) for every strategy: on the fresh model,
  then after a fit (on the model fit left: fully_shard's stays sharded, no re-wrapping, no broadcast of its shards),
  then ``test(ckpt_path="best")`` from a ``ModelCheckpoint``; every metric and prediction is the anchor's: Lightning's
  ``DDPStrategy`` on gloo for ddp / zero, Lightning's ``ModelParallelStrategy`` (torch FSDP2) on gloo for
  fully_shard and auto (which chooses fully_shard here).
- Refusals: an unknown strategy, the FSDP1 front, Lightning's torch-DDP comm hooks, another backend, a
  LightningModule already wrapped.
- The README's Lightning section is examples/lightning_train.py, and it runs under torchrun.

The script runs several runs in one launch; the runs fixture puts every script run these tests need into two launches
(``_jobs``: one per world size), most of a launch being start-up.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

pytest.importorskip("lightning")

from support.harness import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).parent / "support" / "lightning_script.py"
WEIGHTS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
NUM_PARAMS = 8 * 16 + 16 + 16 * 1 + 1
FACTS = ("backend", "ranks_agree", "world", "hosts", "error", "resolved", "planned_params", "wrapper", "optimizer")


class Job(NamedTuple):
    """One torchrun launch of SCRIPT: its world size, the script's options for the whole job, its runs as the tests
    ask for them (kind, then the script's options for that run), and the jobs whose files it reads (launched first).
    """

    world: int
    options: tuple[str, ...]
    runs: tuple[tuple[str, ...], ...]
    after: tuple[str, ...] = ()


def _budget(choice: str) -> str:
    """auto's memory budget (GB, as --budget takes it) just above ``choice``'s model states at 2 ranks."""
    from shardkit import estimate

    return repr(estimate.model_states(NUM_PARAMS, 2, "fp32", "adam", master_weights=False)[choice].total_gb * 1.001)


def _jobs() -> dict[str, Job]:
    """Every launch the runs fixture makes. Most of a launch is start-up (python, torch and Lightning imported on
    every rank), so the runs of one world size share one. Within it the script gives each stretch of runs of one
    process group backend (gloo: ``gloo``, ``model_parallel``; shardkit: the rest) and placement
    (``--one_host_per_rank``) a default group of its own; the first stretch's group Lightning's first Trainer sets up,
    as users' scripts have it, so the shardkit runs come first."""
    ddp_budget, zero3_budget = _budget("ddp"), _budget("zero3")
    return {
        "shardkit": Job(2, (), (
            ("shardkit",), ("ddp",), ("zero1",), ("zero2",), ("fully_shard",),
            ("auto", "--budget", ddp_budget), ("auto", "--budget", zero3_budget),
            ("zero2", "--accumulate", "2"), ("fully_shard", "--accumulate", "2"),
            ("zero2", "--epochs", "1", "--save", "zero2_epoch1.ckpt"),
            ("fully_shard", "--epochs", "1", "--save", "fully_shard_epoch1.ckpt"),
            ("ddp", "--evaluate"), ("zero1", "--evaluate"), ("zero2", "--evaluate"), ("fully_shard", "--evaluate"),
            ("auto", "--evaluate", "--budget", zero3_budget),
            # After many fits in one process: fully_shard's once diverged here (its shared reduce-scatter block's
            # owner outlived an earlier fit on one rank only; _fully_shard._OnePerGroup now resets it).
            ("ddp", "--async_save"), ("zero2", "--async_save"), ("fully_shard", "--async_save"),
            # The anchors: Lightning's own strategies on a gloo group.
            ("gloo",), ("gloo", "--clip", "0"), ("gloo", "--accumulate", "2"),
            ("gloo", "--evaluate"), ("model_parallel", "--evaluate"),
            # On shardkit again, every rank on a simulated host of its own (a group of their own).
            ("shardkit", "--one_host_per_rank"), ("zero2", "--one_host_per_rank"),
            ("fully_shard", "--one_host_per_rank"),
            ("zero2", "--wrapped"),  # last (on one host, a group of its own): nothing runs after its refused fit
        )),
        "resumed_at_3": Job(3, (), (("zero2", "--resume", "zero2_epoch1.ckpt"),
                                    ("fully_shard", "--resume", "fully_shard_epoch1.ckpt")), after=("shardkit",)),
    }


FLAGS = ("--wrapped", "--evaluate", "--async_save", "--one_host_per_rank")  # the script's options that take no value


def _run_spec(kind: str, *options: str) -> str:
    """(kind, "--accumulate", "2", "--evaluate") -> the script's run "kind:accumulate=2:evaluate"."""
    parts, rest = [kind], list(options)
    while rest:
        name = rest.pop(0)
        parts.append(name[2:] if name in FLAGS else f"{name[2:]}={rest.pop(0)}")
    return ":".join(parts)


class Runs:
    """``runs(kind, *options, world=2)``: that run's result. Its job (see _jobs) is launched when a test first asks
    for any of its runs, so a test run alone launches only the jobs it needs; results (or a job's failure) are kept.
    Every job runs in ``root``, where the saves' and resumes' relative paths point."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs = _jobs()
        self.place = {(job.world, run[0], *job.options, *run[1:]): (name, index)
                      for name, job in self.jobs.items() for index, run in enumerate(job.runs)}
        assert len(self.place) == sum(len(job.runs) for job in self.jobs.values()), "a run in two jobs"
        self.done: dict[str, list[dict[str, np.ndarray]] | str] = {}

    def __call__(self, kind: str, *options: str, world: int = 2) -> dict[str, np.ndarray]:
        key = (world, kind, *options)
        assert key in self.place, f"no job in _jobs() holds the run {key}"
        name, index = self.place[key]
        return self.launch(name)[index]

    def launch(self, name: str) -> list[dict[str, np.ndarray]]:
        if name not in self.done:
            job = self.jobs[name]
            for earlier in job.after:
                self.launch(earlier)
            runs = ",".join(_run_spec(*run) for run in job.runs)
            try:  # 30 s a run leaves room on a loaded 2-core machine (a run takes a few seconds)
                proc = run_torchrun(SCRIPT, job.world, str(self.root / name), runs, *job.options,
                                    timeout=120 + 30 * len(job.runs), cwd=self.root)
            except subprocess.TimeoutExpired as timeout:
                self.done[name] = f"timed out: {timeout}"
            else:
                if proc.returncode != 0:
                    self.done[name] = proc.stdout[-2000:] + proc.stderr[-6000:]
                else:
                    results = []
                    for index in range(len(job.runs)):
                        with np.load(self.root / f"{name}.{index}.npz") as data:
                            results.append({k: data[k] for k in data.files})
                    self.done[name] = results
        outcome = self.done[name]
        assert not isinstance(outcome, str), f"job {name} ({self.jobs[name].runs}) failed:\n{outcome}"
        return outcome


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("lightning"))


def _assert_same_weights(ours: dict, theirs: dict, exact: bool, what: str) -> None:
    assert bool(ours["ranks_agree"]) and bool(theirs["ranks_agree"]), what
    assert [k for k in theirs if k not in FACTS and not k.startswith(("initial/", "metric/"))] == WEIGHTS
    for name in WEIGHTS:
        if exact:  # two ranks' sums have one order: bitwise
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=f"{what}: {name}")
        else:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}")
        assert not np.array_equal(ours[name], ours[f"initial/{name}"]), f"{what}: {name} did not train"


# --- Lightning's DDPStrategy on the shardkit backend ----------------------------------------------------------

@pytest.mark.timeout(500)
@pytest.mark.parametrize("placement", [(), ("--one_host_per_rank",)], ids=["one_host", "2_simulated_hosts"])
def test_ddp_strategy_with_the_shardkit_backend_trains_as_on_gloo(runs, placement):
    ours, theirs = runs("shardkit", *placement), runs("gloo")
    assert str(ours["backend"]) == "shardkit" and str(theirs["backend"]) == "gloo"
    assert int(ours["world"]) == 2 and int(ours["hosts"]) == (2 if placement else 1)
    _assert_same_weights(ours, theirs, exact=True, what="DDPStrategy on shardkit")


# --- ShardkitStrategy ------------------------------------------------------------------------------------------

EXPECTED = {"ddp": ("DistributedDataParallel", "AdamW"),
            "zero1": ("DistributedDataParallel", "ZeroRedundancyOptimizer"),
            "zero2": ("DistributedDataParallel", "ZeroRedundancyOptimizer"), "fully_shard": ("FSDPRegression", "AdamW")}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fully_shard"])
def test_every_strategy_trains_as_lightning_ddp_on_gloo(runs, strategy):
    ours, theirs = runs(strategy), runs("gloo")
    assert str(ours["backend"]) == "shardkit" and int(ours["hosts"]) == 1
    assert (str(ours["resolved"]), str(ours["wrapper"]), str(ours["optimizer"])) == (strategy, *EXPECTED[strategy])
    _assert_same_weights(ours, theirs, exact=strategy == "ddp", what=strategy)


@pytest.mark.timeout(500)
def test_clipping_is_active_so_parity_covers_the_global_norm(runs):
    clipped, unclipped = runs("gloo"), runs("gloo", "--clip", "0")
    assert not np.allclose(clipped["net.0.weight"], unclipped["net.0.weight"], rtol=1e-3)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("choice,expected", [("ddp", "ddp"), ("zero3", "fully_shard")])
def test_auto_chooses_by_the_memory_budget_and_trains_as_the_anchor(runs, choice, expected):
    ours, theirs = runs("auto", "--budget", _budget(choice)), runs("gloo")
    assert (str(ours["resolved"]), int(ours["planned_params"])) == (expected, NUM_PARAMS)
    assert (str(ours["wrapper"]), str(ours["optimizer"])) == EXPECTED[expected]
    _assert_same_weights(ours, theirs, exact=expected == "ddp", what=f"auto ({expected})")


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["zero2", "fully_shard"])
def test_gradient_accumulation_trains_as_the_anchor(runs, strategy):
    ours, theirs = runs(strategy, "--accumulate", "2"), runs("gloo", "--accumulate", "2")
    _assert_same_weights(ours, theirs, exact=False, what=f"{strategy}, accumulate 2")
    assert not np.allclose(theirs["net.0.weight"], runs("gloo")["net.0.weight"], rtol=1e-3)  # 4 steps, not 8


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["zero2", "fully_shard"])
def test_on_two_simulated_hosts(runs, strategy):
    ours, theirs = runs(strategy, "--one_host_per_rank"), runs("gloo")
    assert int(ours["hosts"]) == 2
    _assert_same_weights(ours, theirs, exact=False, what=f"{strategy} on 2 hosts")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["zero2", "fully_shard"])
def test_save_checkpoint_then_fit_resumes_at_another_world_size(runs, strategy):
    runs(strategy, "--epochs", "1", "--save", f"{strategy}_epoch1.ckpt")
    checkpoint = runs.root / f"{strategy}_epoch1.ckpt"
    assert checkpoint.is_file()  # one Lightning file, the whole state
    import torch

    saved = torch.load(checkpoint, weights_only=False)
    assert sorted(saved["state_dict"]) == sorted(WEIGHTS) and saved["global_step"] == 4
    assert sorted(saved["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # unsharded, keyed by index
    resumed = runs(strategy, "--resume", checkpoint.name, world=3)
    assert int(resumed["world"]) == 3
    _assert_same_weights(resumed, runs(strategy), exact=False, what=f"{strategy} resumed at 3 ranks")


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fully_shard"])
def test_async_checkpoint_io_saves_the_state_of_its_step_while_training_goes_on(runs, strategy):
    ours = runs(strategy, "--async_save")
    # Lightning's AsyncCheckpointIO, a ModelCheckpoint at every epoch end; each background write waited for the next
    # step (the first save) or fit's end (the last), and holds bitwise the state Lightning built at its step.
    assert list(ours["metric/async/files"]) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert bool(ours["metric/async/step_in_flight/4"])  # training took step 5 while the step-4 save was in flight
    assert bool(ours["metric/async/bitwise/4"]) and bool(ours["metric/async/bitwise/8"])
    plain = runs(strategy)
    _assert_same_weights(ours, plain, exact=True, what=f"{strategy} with async checkpoints")
    for name in WEIGHTS:  # fit(ckpt_path=the step-4 file) ends where the uninterrupted run ended
        np.testing.assert_array_equal(ours[f"metric/resumed/{name}"], plain[name], err_msg=f"{strategy}: {name}")


# --- evaluation: validate / test / predict, fresh and after fit, and test(ckpt_path="best") ------------------------

OURS = ("ddp", "zero1", "zero2", "fully_shard", "auto")
ANCHOR = {"ddp": "gloo", "zero1": "gloo", "zero2": "gloo", "fully_shard": "model_parallel", "auto": "model_parallel"}
METRICS = ("fresh_val_loss", "val_loss", "test_loss", "val_loss_again", "best_score", "best_test_loss")


def _evaluated(runs: Runs, kind: str) -> dict[str, np.ndarray]:
    """kind's --evaluate run (shardkit's five strategies in the shardkit job, the two anchors in the gloo one)."""
    return runs(kind, "--evaluate", *(("--budget", _budget("zero3")) if kind == "auto" else ()))


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", OURS)
def test_validate_test_predict_fresh_and_after_fit_as_lightnings_own_strategy(runs, strategy):
    ours, theirs = _evaluated(runs, strategy), _evaluated(runs, ANCHOR[strategy])
    assert str(ours["backend"]) == "shardkit" and str(theirs["backend"]) == "gloo"
    assert str(ours["resolved"]) == ("fully_shard" if strategy == "auto" else strategy)
    exact = strategy == "ddp"  # two ranks' sums in one order; ZeRO and fully_shard clip from shards (see above)
    _assert_same_weights(ours, theirs, exact=exact, what=f"{strategy} after evaluation")
    for name in METRICS:
        if exact or name == "fresh_val_loss":  # the fresh model: the same weights on every strategy
            assert float(ours[f"metric/{name}"]) == float(theirs[f"metric/{name}"]), name
        else:
            np.testing.assert_allclose(ours[f"metric/{name}"], theirs[f"metric/{name}"], rtol=1e-5, err_msg=name)
    assert float(ours["metric/val_loss"]) < float(ours["metric/fresh_val_loss"])  # evaluated the trained weights
    assert float(ours["metric/val_loss_again"]) == float(ours["metric/val_loss"])
    predictions = ours["metric/predictions"]
    assert predictions.shape == (12, 1)  # rank 0's half of the 24 samples
    if exact:
        np.testing.assert_array_equal(predictions, theirs["metric/predictions"])
    else:
        np.testing.assert_allclose(predictions, theirs["metric/predictions"], rtol=1e-5, atol=1e-6)
    # ModelCheckpoint kept its "best" (mode="max": epoch 0's weights), and test(ckpt_path="best") loaded them into
    # the model fit left (sharded under fully_shard) and evaluated them
    assert str(ours["metric/best_file"]) == str(theirs["metric/best_file"]) == "epoch=0-step=4.ckpt"
    assert float(ours["metric/best_test_loss"]) > float(ours["metric/test_loss"])


@pytest.mark.timeout(1000)
def test_the_fully_shard_anchor_is_lightnings_fsdp2_and_trains_as_its_ddp(runs):
    fsdp2, ddp = _evaluated(runs, "model_parallel"), _evaluated(runs, "gloo")
    assert str(fsdp2["wrapper"]) == "Regression" and str(fsdp2["optimizer"]) == "AdamW"
    _assert_same_weights(fsdp2, ddp, exact=False, what="ModelParallelStrategy vs DDPStrategy on gloo")


# --- refusals --------------------------------------------------------------------------------------------------

def test_strategy_refuses_what_it_cannot_do():
    from shardkit.integrations.lightning import ShardkitStrategy

    assert ShardkitStrategy("auto").resolved_strategy is None and ShardkitStrategy("zero2").resolved_strategy == "zero2"
    with pytest.raises(ValueError, match=r"ShardkitStrategy: strategy must be one of ddp, zero1, zero2, fully_shard "
                                         r"or auto, got 'zero3'"):
        ShardkitStrategy("zero3")
    with pytest.raises(ValueError, match=r"strategy='fsdp' \(shardkit's FSDP1 front\) is not offered under Lightning"):
        ShardkitStrategy("fsdp")
    with pytest.raises(ValueError, match=r"comm_hook='fp16' applies to ddp, zero1 and zero2, not to "
                                         r"strategy='fully_shard'"):
        ShardkitStrategy("fully_shard", comm_hook="fp16")
    with pytest.raises(ValueError, match=r"ddp_comm_hook=<function .*> is Lightning's torch-DDP comm hook"):
        ShardkitStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match=r"process_group_backend must be 'shardkit', got 'gloo'"):
        ShardkitStrategy(process_group_backend="gloo")


@pytest.mark.timeout(500)
def test_fit_refuses_a_module_already_wrapped(runs):
    result = runs("zero2", "--wrapped")
    assert ("ShardkitStrategy (rank 0): a submodule is already wrapped (DistributedDataParallel)"
            in str(result["error"])), str(result["error"])


# --- the README's Lightning section, as written ------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_the_readme_shows_the_example_and_it_runs_under_torchrun(tmp_path):
    from support.harness import assert_readme_shows_example

    example = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
    assert_readme_shows_example("Lightning", example, 2)
    proc = run_torchrun(example, 2, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert re.search(r"^2 processes, zero2: loss \d+\.\d{3}$", proc.stdout, flags=re.M), proc.stdout[-3000:]

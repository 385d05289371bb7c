"""Lightning runs, launched by tests/python/test_lightning.py under torchrun, each as a Lightning user writes it.

    lightning_script.py RESULT RUNS [options]

RUNS is one run or several, comma-separated (``shardkit,zero2:accumulate=2,auto:budget=0.0012``); they run in turn
in this one job, run i (from 0) writing RESULT.i.npz, each from the same start (``seed_everything``, a new model,
data, strategy and Trainer). A run is KIND, then optionally its own options, each ``:NAME=VALUE`` or, for a flag,
``:NAME`` (``gloo:clip=0``, ``zero2:wrapped``, ``zero2:one_host_per_rank``), NAME one of the options below; a VALUE
holds no ``,`` or ``:``. An option on the command line is every run's default; a run's own overrides it.

Process groups: Lightning keeps the group its first Trainer set up, whatever backend a later Trainer asks for. So
consecutive runs of one backend (gloo: ``gloo``, ``model_parallel``; shardkit: the other kinds) and one placement
(``one_host_per_rank``) share a group: the first such stretch's group is the one its first Trainer sets up (env://,
from torchrun, as users' scripts have it); each later stretch gets a new default group made before its first Trainer
(support/matrix.py ``fresh_default_group``: a file store in RESULT.groups/N), on its backend, with SHARDKIT_HOST_ID
set for that stretch alone (shardkit's start-up reads it at every group's start-up). Each stretch's group is
destroyed at its end.

KIND ``gloo`` or ``shardkit``: Lightning's own ``DDPStrategy(process_group_backend=KIND)``; ``model_parallel``:
Lightning's own ``ModelParallelStrategy`` (torch FSDP2) on gloo, the LightningModule's ``configure_model`` sharding
each ``Linear`` as a unit, then ``net``; ``ddp``, ``zero1``, ``zero2``, ``fully_shard`` or ``auto``:
``shardkit.integrations.lightning.ShardkitStrategy(KIND)`` (fully_shard shards each ``Linear`` as a unit; auto
without auto_wrap, so a fully_shard it chooses has one unit, the root).
Options: ``--budget GB`` (auto's memory_budget_gb), ``--accumulate N``, ``--epochs N``, ``--clip V`` (0: none),
``--save CKPT`` (``trainer.save_checkpoint`` after fit), ``--resume CKPT`` (``fit(ckpt_path=CKPT)``),
``--wrapped`` (the LightningModule wraps its net in torch's DDP in ``configure_model``; fit must refuse it),
``--evaluate``: the evaluation sequence below; ``--async_save``: the asynchronous checkpoint run below;
``--one_host_per_rank`` (every rank on a simulated host of its own: the hierarchical engine).

``--evaluate``: ``validate`` on the fresh model, then ``fit`` with a validation loader and a ``ModelCheckpoint``
(in RESULT.i.checkpoints) keeping the epoch of the highest ``val_loss`` (the first, not the weights fit ends with),
then ``validate``, ``test``, ``predict`` on the model fit left, then ``test(ckpt_path="best")``; the result holds
each metric (logged with ``sync_dist``) and rank 0's predictions.

``--async_save``: ``fit`` with Lightning's ``AsyncCheckpointIO`` over a ``TorchCheckpointIO`` that writes each
file only once training has taken a step after it (or fit has ended), and a ``ModelCheckpoint`` saving at every
epoch end (in RESULT.i.async); the LightningModule's ``on_save_checkpoint`` keeps a deep copy of each checkpoint as
Lightning built it (the state at its step). After fit, rank 0 reads each file back and records whether it equals
that copy bitwise and whether a training step ran while it was in flight; then a new Trainer resumes from the
epoch-0 file (``fit(ckpt_path=...)``) and its final weights are recorded as ``resumed/NAME``.

The data's global batch is 12 samples at any world size (DistributedSampler's split), 4 batches per epoch, so runs
at different world sizes see the same arithmetic. Rank 0 writes each run's result (an .npz): the weights after fit
(whole, gathered from fully_shard's DTensors) and before, what the job ran on, what the strategy chose and wrapped
with.
"""

from __future__ import annotations

import argparse
import copy
import os

import numpy as np
import torch
from torch import nn

GLOBAL_BATCH = 12
SAMPLES = 48


GLOO_KINDS = ("gloo", "model_parallel")
SHARDKIT_KINDS = ("shardkit", "ddp", "zero1", "zero2", "fully_shard", "auto")
# A run's own options (``:NAME=VALUE``, a flag ``:NAME``): the type each VALUE converts to, bool for a flag.
RUN_OPTIONS = {"budget": float, "accumulate": int, "epochs": int, "clip": float, "save": str, "resume": str,
               "wrapped": bool, "evaluate": bool, "async_save": bool, "one_host_per_rank": bool}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("runs")
    parser.add_argument("--budget", type=float)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--one_host_per_rank", action="store_true")
    parser.add_argument("--wrapped", action="store_true")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--async_save", action="store_true")
    args = parser.parse_args()
    runs = [parse_run(spec, args) for spec in args.runs.split(",")]
    import itertools
    import sys
    from pathlib import Path

    import shardkit  # noqa: F401 - registers the "shardkit" backend

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' directory: support.matrix
    from support.matrix import fresh_default_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # read once: a Trainer's teardown clears it
    numbered = list(enumerate(runs))

    def group_of(numbered_run) -> tuple[str, bool]:
        _, (kind, options) = numbered_run
        return ("gloo" if kind in GLOO_KINDS else "shardkit"), options.one_host_per_rank

    for stretch, ((backend, hosts), members) in enumerate(itertools.groupby(numbered, key=group_of)):
        directory = f"{args.result}.groups/{stretch}"
        os.makedirs(directory, exist_ok=True)
        # hosts: each rank on a simulated host of its own (the hierarchical engine), for this stretch alone.
        # The group is destroyed at the stretch's end, the last one's too: torch asks scripts to end with this and
        # Lightning does not do it. Without it, fully_shard runs (DTensor's functional collectives) sometimes aborted
        # at interpreter exit, after everything here had finished ("terminate called without an active exception",
        # SIGABRT on one rank): an open bug in shardkit's teardown at exit, recorded in the session note, not what
        # these parity tests check.
        with fresh_default_group(None if stretch == 0 else backend, rank, world, directory, 120.0,
                                 env={"SHARDKIT_HOST_ID": f"host{rank}"} if hosts else None):
            for index, (kind, options) in members:
                run(kind, options, world, f"{args.result}.{index}")


def parse_run(spec: str, job: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """``KIND[:NAME=VALUE|:NAME]...`` -> (KIND, the job's options with the run's own in their place)."""
    kind, *settings = spec.split(":")
    if kind not in GLOO_KINDS + SHARDKIT_KINDS:
        raise SystemExit(f"run {spec!r}: kind must be one of {', '.join(GLOO_KINDS + SHARDKIT_KINDS)}, got {kind!r}")
    options = vars(job).copy()
    for setting in settings:
        name, has_value, value = setting.partition("=")
        convert = RUN_OPTIONS.get(name)
        if convert is None:
            raise SystemExit(f"run {spec!r}: a run's option is one of {', '.join(RUN_OPTIONS)}, got {name!r}")
        if (convert is bool) == bool(has_value):
            raise SystemExit(f"run {spec!r}: {name} " + ("is a flag, given without a value" if convert is bool
                                                          else "needs a value, as :NAME=VALUE"))
        options[name] = True if convert is bool else convert(value)
    return kind, argparse.Namespace(**options)


def run(kind: str, args: argparse.Namespace, world: int, result: str) -> None:
    """One run with its own options ``args``: rank 0 writes ``{result}.npz``; an evaluation's checkpoints go in
    ``{result}.checkpoints``."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def configure_model(self) -> None:
            if args.wrapped:
                self.net = torch.nn.parallel.DistributedDataParallel(self.net)
            if kind == "model_parallel" and not isinstance(self.net, FSDPModule):  # every stage calls it
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[2], self.net):
                    fully_shard(layer, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        def on_save_checkpoint(self, checkpoint) -> None:
            if args.async_save:  # the state at this step, as Lightning built it, before any write
                saved_states[checkpoint["global_step"]] = copy.deepcopy(
                    {key: checkpoint[key] for key in ("state_dict", "optimizer_states", "lr_schedulers")})

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Record(pl.Callback):
        """What the strategy set up, seen from inside fit."""

        def on_train_start(self, trainer, pl_module) -> None:
            facts.update(wrapper=type(trainer.strategy.model).__name__,
                         optimizer=type(trainer.strategy.optimizers[0]).__name__)

    def new_strategy():
        if kind in ("gloo", "shardkit"):
            return DDPStrategy(process_group_backend=kind)
        if kind == "model_parallel":
            return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                         process_group_backend="gloo")
        from shardkit.integrations.lightning import ShardkitStrategy

        return ShardkitStrategy(kind, auto_wrap=["Linear"] if kind == "fully_shard" else None,
                                memory_budget_gb=args.budget if kind == "auto" else None)

    strategy = new_strategy()
    facts: dict = {}
    saved_states: dict = {}
    pl.seed_everything(0, verbose=False)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world)
    x_val = torch.randn(SAMPLES // 2, 8, generator=torch.Generator().manual_seed(2))
    evaluation = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_val, x_val.sum(dim=1, keepdim=True).sin()), batch_size=GLOBAL_BATCH // world)
    model = Regression()
    initial = {f"initial/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    callbacks: list = [Record()]
    if args.evaluate:
        # keeps the epoch of the highest val_loss, the first: so test(ckpt_path="best") must load other weights
        best = ModelCheckpoint(dirpath=f"{result}.checkpoints", monitor="val_loss", mode="max", save_top_k=1)
        callbacks.append(best)
    plugins: list = []
    if args.async_save:
        steps, async_io, in_flight = _held_writes(pl)
        plugins.append(async_io)
        callbacks += [steps, ModelCheckpoint(dirpath=f"{result}.async", save_top_k=-1, every_n_epochs=1)]
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
                         logger=False, enable_checkpointing=args.evaluate or args.async_save,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, plugins=plugins)
    error = ""
    metrics: dict = {}
    try:
        if args.evaluate:
            metrics["fresh_val_loss"] = trainer.validate(model, evaluation, verbose=False)[0]["val_loss"]
        trainer.fit(model, loader, evaluation if args.evaluate else None, ckpt_path=args.resume)
        if args.evaluate:
            metrics["val_loss"] = trainer.validate(model, evaluation, verbose=False)[0]["val_loss"]
            metrics["test_loss"] = trainer.test(model, evaluation, verbose=False)[0]["test_loss"]
            metrics["predictions"] = torch.cat(trainer.predict(model, evaluation)).detach()
            metrics["val_loss_again"] = trainer.validate(model, evaluation, verbose=False)[0]["val_loss"]
            metrics["best_score"] = best.best_model_score.item()
            metrics["best_file"] = os.path.basename(best.best_model_path)
            metrics["best_test_loss"] = trainer.test(model, evaluation, ckpt_path="best", verbose=False)[0][
                "test_loss"]
    except ValueError as refused:
        if not args.wrapped:
            raise
        error = str(refused)
    if args.async_save:  # fit's teardown waited for the writes
        metrics.update(_compare_async_saves(f"{result}.async", saved_states, in_flight)
                       if dist.get_rank() == 0 else {})
        resumed = pl.Trainer(accelerator="cpu", devices=world, strategy=new_strategy(),
                             max_epochs=args.epochs, gradient_clip_val=args.clip or None, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        again = Regression()
        resumed.fit(again, loader, ckpt_path=f"{result}.async/epoch=0-step=4.ckpt")
        metrics.update({f"resumed/{k}": (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                        for k, v in again.state_dict().items()})
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank: a collective for the sharded strategies
    # The LightningModule's own weights after fit (fully_shard: DTensor shards, gathered in state_dict order).
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
               for k, v in model.state_dict().items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)  # every rank holds the same weights
    hosts = 0
    if dist.get_backend() == "shardkit":
        from shardkit.backend import host_topology

        hosts = host_topology().num_hosts
    plan = getattr(getattr(strategy, "spec", None), "auto_plan", None)
    if dist.get_rank() == 0:
        same = all(np.array_equal(w[k], weights[k]) for w in gathered for k in weights)
        np.savez(f"{result}.npz", backend=np.array(dist.get_backend()), ranks_agree=np.array(same),
                 world=np.array(dist.get_world_size()), hosts=np.array(hosts), error=np.array(error),
                 resolved=np.array(str(getattr(strategy, "resolved_strategy", None))),
                 planned_params=np.array(plan.num_params if plan else 0),
                 wrapper=np.array(facts.get("wrapper", "")), optimizer=np.array(facts.get("optimizer", "")),
                 **{f"metric/{k}": np.asarray(v) for k, v in metrics.items()}, **weights, **initial)


def _held_writes(pl):
    """(a callback tracking training's steps, Lightning's ``AsyncCheckpointIO`` over a ``TorchCheckpointIO`` whose
    background writes each wait for a step after their own or for the end of fit, so that a step runs while every
    save but fit's last is in flight, and ``in_flight``: saved step -> whether a step ran while it was)."""
    import threading

    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    progress = threading.Condition()
    seen = {"step": 0, "ended": False}
    in_flight: dict[int, bool] = {}

    class Held(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            step = checkpoint["global_step"]
            with progress:
                if not progress.wait_for(lambda: seen["step"] > step or seen["ended"], timeout=120):
                    raise TimeoutError(f"the write of {path} (step {step}) saw no later step nor fit's end in 120 s")
                in_flight[step] = seen["step"] > step
            super().save_checkpoint(checkpoint, path, storage_options)

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            with progress:
                seen["step"] = trainer.global_step
                progress.notify_all()

        def on_train_end(self, trainer, pl_module) -> None:
            with progress:
                seen["ended"] = True
                progress.notify_all()

    return Steps(), AsyncCheckpointIO(Held()), in_flight


def _compare_async_saves(directory: str, saved_states: dict, in_flight: dict) -> dict:
    """Each file of ``directory`` against the state Lightning built at its step: ``async/files``, and per file
    ``async/bitwise/STEP``, ``async/step_in_flight/STEP``."""
    out: dict = {"async/files": np.array(sorted(os.listdir(directory)))}
    for name in sorted(os.listdir(directory)):
        written = torch.load(os.path.join(directory, name), weights_only=True)
        step = written["global_step"]
        out[f"async/bitwise/{step}"] = _same(written, saved_states[step])
        out[f"async/step_in_flight/{step}"] = in_flight[step]
    return out


def _same(written, expected) -> bool:
    """Whether every entry of ``expected`` is in ``written``, tensors bitwise (same dtype, shape and bytes)."""
    if isinstance(expected, torch.Tensor):
        return (isinstance(written, torch.Tensor) and written.dtype == expected.dtype
                and written.shape == expected.shape
                and torch.equal(written.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)))
    if isinstance(expected, dict):
        return isinstance(written, dict) and all(k in written and _same(written[k], v) for k, v in expected.items())
    if isinstance(expected, (list, tuple)):
        return len(written) == len(expected) and all(_same(w, e) for w, e in zip(written, expected))
    return written == expected


if __name__ == "__main__":
    main()

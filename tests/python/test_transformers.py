"""shardkit inside the Hugging Face Trainer (python/shardkit/integrations/transformers.py), launched as its users
launch it: ``torchrun`` of a training script whose command line transformers' ``HfArgumentParser`` reads
(tests/python/support/trainer_script.py). The runs share torchrun jobs, one per world size (``_jobs``: start-up is
most of a run's time); each run has its own Trainer, model, seeds, output directory and default process group (on
its own backend and simulated host layout), as when it ran alone.

- Every strategy trains as transformers' own Trainer with torch's DDP on gloo (the anchor): a small GPT-2, 4 steps
  of 2 accumulated micro-batches, gradient clipping, a linear schedule; the same logged gradient norms and the same
  weights.
- ``--bf16 true`` trains (ddp: as the anchor with bf16 autocast; fully_shard and fsdp: with accelerate's FSDP
  plugins' bf16 casts, near it), and ``--load_best_model_at_end true`` leaves the model the best checkpoint's,
  bitwise, as the anchor's (ddp, zero2, fully_shard, fsdp).
- ``save_model`` writes a plain Hugging Face directory (no prefix, the tied weight once) that ``from_pretrained``
  loads with nothing missing, bitwise equal to the trained weights.
- ``resume_from_checkpoint`` of a checkpoint saved at one world size, at another, ends where the run that never
  stopped ended.
- ``--shardkit_strategy auto`` with a ``--shardkit_memory_budget_gb`` that holds DDP's model states chooses ddp, one
  that holds only ZeRO-3's chooses fully_shard, and either trains as the anchor.
- Wrong use raises, naming the feature.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.harness import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).parent / "support" / "trainer_script.py"
MICRO_BATCH = 6  # samples per micro-batch over all ranks: divisible by every world size used (1, 2, 3)
# AdamW with the Trainer's two groups (weight decay on matrices, none on biases and norms). Its epsilon is raised
# from 1e-8: the attention's key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a shift
# per query), so its computed gradient is rounding noise, which Adam with a tiny epsilon turns into full-size
# steps; another reduction order (ZeRO clips from shards) then moves it by 1e-5 while every other weight agrees to
# 1e-7.
COMMON = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5", "--learning_rate",
          "1e-2", "--weight_decay", "0.01", "--adam_epsilon", "1e-4", "--lr_scheduler_type", "linear",
          "--logging_steps", "1", "--save_steps", "2", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]
STRATEGIES = ["ddp", "zero1", "zero2", "fully_shard", "fsdp"]


ANCHOR = ["--anchor", "--use_cpu", "true", "--ddp_backend", "gloo"]  # transformers' Trainer, torch DDP on gloo
# bf16 autocast (--bf16 true; on a host without a GPU transformers asks for --use_cpu true with it, for its own
# Trainer and so for shardkit's), with an evaluation every 2 steps and the best checkpoint loaded at the end. The best
# is the one with the lowest evaluation loss: checkpoint-2 (on these random tokens the loss on the evaluated samples
# rises again by step 4), so that loading it changes the model.
BF16_BEST = ("--bf16", "true", "--use_cpu", "true", "--eval_strategy", "steps", "--eval_steps", "2",
             "--load_best_model_at_end", "true", "--metric_for_best_model", "loss", "--with_eval", "true")
AUTO_CHOICES = {"ddp": "ddp", "zero3": "fully_shard"}  # the memory budget that holds this choice's model states
RESUMED = {"ddp": 3, "zero1": 1, "zero2": 3, "fully_shard": 3, "fsdp": 3}  # the world size each resumes at


def _auto_budget(choice: str) -> float:
    """A memory budget (GB) that just holds ``choice``'s model states at world 2 (AdamW, fp32)."""
    from shardkit import estimate
    from support.trainer_script import gpt2

    params = sum(p.numel() for p in gpt2().parameters())  # the tied head counted once, as the plan counts
    return estimate.model_states(params, 2, "fp32", "adam", master_weights=False)[choice].total_gb * 1.001


@dataclasses.dataclass
class Job:
    """One torchrun of the script running several Trainer runs in turn (``--runs``): start-up (python, torch,
    transformers on every rank) is most of a run's time, so runs share jobs. A job has one world size; its runs
    each get a default process group of their own (the first one's the Trainer starts, as users' scripts have it),
    on their own backend (gloo for the anchor, shardkit otherwise) and placement (simulated hosts: SHARDKIT_HOST_ID
    set for that run alone; shardkit reads it at every group's start-up)."""
    world: int
    runs: dict[str, list[str]]  # each run's name and its arguments (besides COMMON, batch size, output, result)
    after: tuple[str, ...] = ()  # jobs whose output this one reads (checkpoints to resume), launched before it


def _jobs(root: Path) -> dict[str, Job]:
    shardkit = {strategy: ["--shardkit_strategy", strategy] for strategy in STRATEGIES}
    shardkit.update({f"{strategy}-bf16": ["--shardkit_strategy", strategy, *BF16_BEST]
                     for strategy in ("ddp", "zero2", "fully_shard", "fsdp")})
    shardkit.update({f"auto-{choice}": ["--shardkit_strategy", "auto", "--shardkit_memory_budget_gb",
                                        repr(_auto_budget(choice))] for choice in AUTO_CHOICES})
    resumes = {world: {f"{strategy}-resumed": ["--shardkit_strategy", strategy, "--resume",
                                               str(root / "shardkit" / strategy / "out" / "checkpoint-2")]
                       for strategy, at in RESUMED.items() if at == world} for world in set(RESUMED.values())}
    # One world-2 job: shardkit's runs first (ddp's Trainer starts the job's first group, on shardkit, as users'
    # scripts do), then the anchor's on gloo, then the runs on simulated hosts.
    shardkit.update({"anchor": ANCHOR, "anchor-bf16": [*ANCHOR, *BF16_BEST]})
    shardkit.update({f"{strategy}-hosts": ["--shardkit_strategy", strategy, "--one_host_per_rank", "true"]
                     for strategy in ("zero2", "fully_shard")})
    return {
        "shardkit": Job(2, shardkit),
        **{f"world{world}": Job(world, runs, after=("shardkit",)) for world, runs in resumes.items()},
    }


class Runs:
    """Every Trainer run the module compares, in the jobs of ``_jobs``; a job is launched when one of its runs is first
    asked for (so ``-k`` on one test launches only the jobs it needs), each once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs = _jobs(root)
        self.launched: dict[str, subprocess.CompletedProcess] = {}

    def __call__(self, strategy: str | None, *settings: str) -> tuple[Path, dict, dict[str, np.ndarray]]:
        """The uninterrupted world-2 run of ``strategy`` (the anchor: None), plain or with ``BF16_BEST``: its
        directory, its facts and its arrays (rank 0's)."""
        assert settings in ((), BF16_BEST), settings
        return self.run(f"{strategy or 'anchor'}{'-bf16' if settings else ''}")

    def run(self, name: str) -> tuple[Path, dict, dict[str, np.ndarray]]:
        (job,) = [job for job, planned in self.jobs.items() if name in planned.runs]
        proc = self._launch(job)
        directory = self.root / job / name
        result = directory / "result.npz"
        errors = "".join(path.read_text() for path in sorted(directory.glob("result.npz.rank*.error")))
        assert result.is_file() and not errors, f"{name} (job {job}):\n{errors}\n" + proc.stdout[-2000:] + \
            proc.stderr[-6000:]
        with np.load(result) as data:
            return directory, json.loads(str(data["facts"])), {k: data[k] for k in data.files if k != "facts"}

    def _launch(self, job: str) -> subprocess.CompletedProcess:
        if job not in self.launched:
            for earlier in self.jobs[job].after:
                self._launch(earlier)
            world, runs = self.jobs[job].world, self.jobs[job].runs
            directory = self.root / job
            directory.mkdir()
            plan = [[*COMMON, "--per_device_train_batch_size", str(MICRO_BATCH // world), *extra,
                     "--output_dir", str(directory / name / "out"), "--result", str(directory / name / "result.npz")]
                    for name, extra in runs.items()]
            (directory / "runs.json").write_text(json.dumps(plan))
            self.launched[job] = run_torchrun(SCRIPT, world, "--runs", str(directory / "runs.json"),
                                              timeout=120 + 60 * len(plan), cwd=directory)
        return self.launched[job]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("trainer"))


def _weights(arrays: dict[str, np.ndarray], kind: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: torch.from_numpy(v) for k, v in arrays.items() if k.startswith(kind + "/")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_as_the_trainer_with_torch_ddp_on_gloo(runs, strategy):
    _, anchor_facts, anchor_arrays = runs(None)
    _, facts, arrays = runs(strategy)
    assert anchor_facts["backend"] == "gloo" and anchor_facts["wrapper"] == "DistributedDataParallel", anchor_facts
    # one host: the simulated hosts' runs share this job, their SHARDKIT_HOST_ID set for their own runs alone
    assert facts["backend"] == "shardkit" and facts["world"] == 2 and facts["hosts"] == 1, facts
    expected = {"ddp": "DistributedDataParallel", "zero1": "DistributedDataParallel",
                "zero2": "DistributedDataParallel",
                "fsdp": "FullyShardedDataParallel"}.get(strategy, "FSDPGPT2LMHeadModel")
    assert facts["wrapper"] == expected, facts
    assert facts["optimizer"] == ("ZeroRedundancyOptimizer" if strategy.startswith("zero") else "AdamW"), facts
    assert len(facts["norms"]) == 4
    torch.testing.assert_close(torch.tensor(facts["norms"]), torch.tensor(anchor_facts["norms"]), rtol=1e-5, atol=1e-6)
    ours, theirs = _weights(arrays, "trained"), _weights(anchor_arrays, "trained")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["zero2", "fully_shard"])
def test_on_two_simulated_hosts_too(runs, strategy):
    """Each rank on a host of its own: the collectives go through the hierarchical engine (gloo between hosts)."""
    _, anchor_facts, anchor_arrays = runs(None)
    _, facts, arrays = runs.run(f"{strategy}-hosts")
    assert facts["backend"] == "shardkit" and facts["hosts"] == 2, facts
    torch.testing.assert_close(torch.tensor(facts["norms"]), torch.tensor(anchor_facts["norms"]), rtol=1e-5, atol=1e-6)
    ours, theirs = _weights(arrays, "trained"), _weights(anchor_arrays, "trained")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_model_writes_a_directory_from_pretrained_loads(runs, strategy):
    _, facts, arrays = runs(strategy)
    assert "transformer.wte.weight" in facts["saved_keys"] and "lm_head.weight" not in facts["saved_keys"], facts
    assert not any(k.startswith("module.") for k in facts["saved_keys"]), facts["saved_keys"][:3]
    assert not any(facts["loading_info"].values()), facts["loading_info"]  # nothing missing or unexpected
    trained, loaded = _weights(arrays, "trained"), _weights(arrays, "loaded")
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"{strategy}: {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy,load_world", list(RESUMED.items()))
def test_resume_from_checkpoint_at_another_world_size(runs, strategy, load_world):
    directory, uninterrupted, arrays = runs(strategy)
    checkpoint = directory / "out" / "checkpoint-2"
    sharded = strategy != "ddp"
    assert (checkpoint / "shardkit").is_dir() == sharded and (checkpoint / "optimizer.pt").is_file() != sharded
    _, facts, resumed = runs.run(f"{strategy}-resumed")
    assert facts["world"] == load_world
    # The log holds steps 1-2 from the checkpoint's trainer state and steps 3-4 as the resumed run computed them.
    torch.testing.assert_close(torch.tensor(facts["norms"]), torch.tensor(uninterrupted["norms"]), rtol=1e-5,
                               atol=1e-6)
    ours, theirs = _weights(resumed, "trained"), _weights(arrays, "trained")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("choice,expected,wrapper", [("ddp", "ddp", "DistributedDataParallel"),
                                                     ("zero3", "fully_shard", "FSDPGPT2LMHeadModel")])
def test_auto_chooses_by_the_memory_budget_and_trains_as_the_anchor(runs, choice, expected, wrapper):
    _, anchor_facts, anchor_arrays = runs(None)
    _, facts, arrays = runs.run(f"auto-{choice}")  # its budget: _auto_budget(choice)
    assert (facts["resolved"], facts["wrapper"]) == (expected, wrapper), facts
    torch.testing.assert_close(torch.tensor(facts["norms"]), torch.tensor(anchor_facts["norms"]), rtol=1e-5, atol=1e-6)
    ours, theirs = _weights(arrays, "trained"), _weights(anchor_arrays, "trained")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=f"auto ({expected}): {name}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fully_shard", "fsdp"])
def test_bf16_with_the_best_model_loaded_at_the_end(runs, strategy):
    _, anchor_facts, anchor_arrays = runs(None, *BF16_BEST)
    _, facts, arrays = runs(strategy, *BF16_BEST)
    for who, found, weights in (("anchor", anchor_facts, anchor_arrays), (strategy, facts, arrays)):
        assert found["best_model_checkpoint"].endswith("checkpoint-2"), (who, found["best_model_checkpoint"])
        best, last, trained = _weights(weights, "best"), _weights(weights, "last"), _weights(weights, "trained")
        assert any(not torch.equal(best[k], last[k]) for k in best), who  # loading the best changes the model
        for name, value in best.items():  # the model is the best checkpoint's, bitwise
            torch.testing.assert_close(trained[name], value, rtol=0, atol=0, msg=f"{who}: {name}")
    assert len(facts["norms"]) == len(anchor_facts["norms"]) == 4
    if strategy == "ddp":  # the same autocast as the anchor's torch DDP: the same numbers
        rtol, atol = 1e-5, 1e-6
    elif strategy == "zero2":  # the same autocast, but the clipping norm adds the shards' squares in another order
        # than torch's clip_grad_norm_ (last bits); bf16 activations grow that over the steps (measured: norms 6.4e-5
        # relative on an AMD EPYC with avx512_bf16, under 1e-5 on an Intel Xeon)
        rtol, atol = 2e-4, 1e-4
    else:  # accelerate's FSDP plugins' bf16: parameters and reductions cast to bf16 (MixedPrecisionPolicy /
        # MixedPrecision) besides or instead of the autocast, so bf16's rounding apart from the anchor's (measured:
        # norms 6e-4, weights 5e-3 at most)
        rtol, atol = 1e-2, 1e-2
    torch.testing.assert_close(torch.tensor(facts["norms"]), torch.tensor(anchor_facts["norms"]), rtol=rtol, atol=atol)
    ours, theirs = _weights(arrays, "trained"), _weights(anchor_arrays, "trained")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=rtol, atol=atol, msg=f"{strategy}: {name}")


def test_arguments_refuse_what_they_cannot_do(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    from shardkit.integrations.transformers import ShardkitTrainingArguments, Trainer

    with pytest.raises(ValueError, match=r"ddp_backend must be 'shardkit', got 'gloo'"):
        ShardkitTrainingArguments(output_dir=str(tmp_path), ddp_backend="gloo")
    with pytest.raises(ValueError,
                       match=r"strategy must be one of ddp, zero1, zero2, fully_shard, fsdp or auto, got 'zero3'"):
        ShardkitTrainingArguments(output_dir=str(tmp_path), shardkit_strategy="zero3")
    with pytest.raises(ValueError, match=r"auto_wrap applies to fully_shard and fsdp .*, not to strategy='ddp'"):
        ShardkitTrainingArguments(output_dir=str(tmp_path), shardkit_auto_wrap=["GPT2Block"])
    parser = HfArgumentParser(ShardkitTrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--shardkit_strategy", "zero2",
                                                    "--shardkit_comm_hook", "bf16"])
    assert (parsed.shardkit_strategy, parsed.shardkit_comm_hook, parsed.ddp_backend) == ("zero2", "bf16", "shardkit")
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--shardkit_strategy", "auto",
                                                    "--shardkit_memory_budget_gb", "2.5"])
    assert (parsed.shardkit_strategy, parsed.shardkit_memory_budget_gb) == ("auto", 2.5)
    assert parsed.shardkit_plugin(None).resolved_strategy is None  # chosen when the Trainer prepares the model
    with pytest.raises(ValueError, match=r"memory_budget_gb applies to strategy='auto', not to strategy='ddp'"):
        ShardkitTrainingArguments(output_dir=str(tmp_path), shardkit_memory_budget_gb=2.5)
    with pytest.raises(SystemExit):  # argparse's refusal of a choice it does not offer
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--shardkit_strategy", "zero3"])
    with pytest.raises(TypeError, match=r"args must be ShardkitTrainingArguments, got TrainingArguments"):
        Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(output_dir=str(tmp_path)))


@pytest.mark.timeout(300)
def test_the_readme_shows_the_example_and_it_runs_under_torchrun(tmp_path):
    import re

    from support.harness import assert_readme_shows_example

    example = Path(__file__).resolve().parents[2] / "examples" / "trainer_train.py"
    assert_readme_shows_example("Hugging Face Trainer", example, 2)

    result = run_torchrun(example, 2, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert re.search(r"^2 processes on shardkit: loss \d+\.\d{3}$", result.stdout, flags=re.M), result.stdout[-3000:]
    from transformers import GPT2LMHeadModel

    loaded, info = GPT2LMHeadModel.from_pretrained(tmp_path / "trainer_output" / "final", output_loading_info=True)
    assert not any(v for k, v in info.items() if k != "error_msgs"), info

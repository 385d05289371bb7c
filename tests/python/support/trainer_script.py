"""Hugging Face Trainer runs, launched by tests/python/test_transformers.py under torchrun.

A run's arguments are the Trainer's command line, parsed by transformers' own ``HfArgumentParser`` (as a training
script of the users' guides does), plus this script's: ``--anchor`` (transformers' own Trainer and TrainingArguments,
torch's DDP on gloo), ``--one_host_per_rank`` (simulated hosts: the hierarchical engine), ``--resume <checkpoint>``,
``--with_eval`` (an evaluation set, the first 24 training samples, for ``--eval_strategy`` and
``--load_best_model_at_end``; the best checkpoint's and the last checkpoint's model files then come back too) and
``--result <file>``. It trains a small GPT-2 (no dropout, so
that runs at different world sizes see the same arithmetic), then ``save_model`` to ``<output_dir>/final``; rank 0
loads that directory with ``from_pretrained`` and writes what the test compares to ``--result`` (an .npz).

``--runs <file.json>`` instead (a list of such argument lists) runs each in turn in this one job, so that the
interpreter's and the libraries' start-up is paid once per job rather than once per run (most of a run's time). The
first run starts its default process group as users' scripts do (the TrainingArguments start it); each later one gets
a fresh group on its own backend (gloo for ``--anchor``, else shardkit) and placement (``--one_host_per_rank`` sets
SHARDKIT_HOST_ID for that run only), its own output directory, seeds and model, and accelerate's state reset, as the
matrix's Trainer entry point runs its cells (support/matrix.py, support/matrix_trainer.py). A run that raises leaves
its traceback in ``<result>.rank<N>.error`` and the job goes on to the next; the job then exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import torch


@dataclasses.dataclass
class Case:
    anchor: bool = False
    one_host_per_rank: bool = False  # each rank on a simulated host of its own (SHARDKIT_HOST_ID)
    resume: str | None = None
    with_eval: bool = False
    result: str = "result.npz"


def gpt2():
    """The model trained: a small GPT-2 without dropout, its head tied to the embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def placement(argv: list[str]) -> dict[str, str]:
    """The environment of a run's placement: ``--one_host_per_rank`` puts each rank on a simulated host of its own
    (set before the run's group starts, for that run alone: support/matrix.py ``fresh_default_group``)."""
    import os

    return {"SHARDKIT_HOST_ID": f"host{os.environ['RANK']}"} if "--one_host_per_rank" in argv else {}


def train(argv: list[str]) -> None:
    """One run, ``argv`` its command line."""
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel, HfArgumentParser

    if "--anchor" in argv:
        from transformers import Trainer, TrainingArguments
    else:
        from shardkit.integrations.transformers import ShardkitTrainingArguments as TrainingArguments
        from shardkit.integrations.transformers import Trainer
    args, case = HfArgumentParser((TrainingArguments, Case)).parse_args_into_dataclasses(args=argv)

    torch.manual_seed(0)
    model = gpt2()
    tokens = torch.randint(0, 64, (96, 12), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      eval_dataset=dataset[:24] if case.with_eval else None)
    trainer.train(resume_from_checkpoint=case.resume)
    final = f"{args.output_dir}/final"
    trainer.save_model(final)
    trained = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # a collective when sharded
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    hosts = None
    if dist.get_backend() == "shardkit":
        from shardkit.backend import host_topology

        hosts = host_topology().num_hosts
    facts = {"backend": dist.get_backend(), "world": dist.get_world_size(), "hosts": hosts, "norms": norms,
             "wrapper": type(trainer.model_wrapped).__name__,
             "resolved": trainer.accelerator.shardkit_plugin.resolved_strategy if not case.anchor else None,
             "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
             "best_model_checkpoint": trainer.state.best_model_checkpoint}
    trainer.accelerator.wait_for_everyone()
    if dist.get_rank() != 0:
        return
    from safetensors.torch import load_file

    loaded, info = GPT2LMHeadModel.from_pretrained(final, output_loading_info=True)
    facts["saved_keys"] = sorted(load_file(f"{final}/model.safetensors"))
    facts["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}
    arrays = {f"trained/{k}": v.detach().float().numpy() for k, v in trained.items()}
    arrays.update({f"loaded/{k}": v.detach().float().numpy() for k, v in loaded.state_dict().items()})
    if case.with_eval:  # the model files of the best checkpoint and of the last one
        last = f"{args.output_dir}/checkpoint-{trainer.state.global_step}"
        for kind, directory in (("best", trainer.state.best_model_checkpoint), ("last", last)):
            arrays.update({f"{kind}/{k}": v.float().numpy() for k, v in
                           load_file(f"{directory}/model.safetensors").items()})
    np.savez(case.result, facts=np.array(json.dumps(facts)), **arrays)



def main() -> None:
    import os

    if "--runs" not in sys.argv:
        os.environ.update(placement(sys.argv))  # before the Trainer starts the group
        train(sys.argv[1:])
        return
    import traceback
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' directory: support.matrix
    from support.matrix import fresh_default_group
    from support.matrix_trainer import _reset_accelerate

    runs = json.loads(Path(sys.argv[sys.argv.index("--runs") + 1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    failed = []
    for index, argv in enumerate(runs):
        result = Path(argv[argv.index("--result") + 1])
        result.parent.mkdir(parents=True, exist_ok=True)
        backend = "gloo" if "--anchor" in argv else "shardkit"  # each run's own: the anchor's is torch DDP on gloo
        try:
            # The first run's TrainingArguments start the group (env://, from torchrun); later runs get a new one,
            # through a file store of their own beside their result, on their own backend and placement.
            with fresh_default_group(None if index == 0 else backend, rank, world, str(result.parent), 120.0,
                                     env=placement(argv)):
                try:
                    train(argv)
                finally:
                    _reset_accelerate()
        except Exception:  # noqa: BLE001 - recorded for the test; the job's other runs go on
            failed.append(str(result))
            Path(f"{result}.rank{rank}.error").write_text(traceback.format_exc())
    if failed:
        sys.exit(f"rank {rank}: runs failed: {failed}")


if __name__ == "__main__":
    main()

"""``accelerate launch`` and accelerate's config file with shardkit's Accelerator
(shardkit/integrations/_launch_config.py).

- ``accelerate launch --multi_gpu --num_processes 2`` (torchrun underneath) trains the README's accelerate example
  on 2 CPU processes on the shardkit backend.
- A config file with ``distributed_type: FSDP, fsdp_version: 2`` and transformer-based wrapping makes the
  Accelerator (given no plugin) shard with ``fully_shard``, each named block a unit of its own, and trains to the
  same loss as the same job with that ShardkitPlugin passed explicitly (that anchor runs in harness ranks).
- ``--multi_gpu`` with an FSDP config file: accelerate ignores the file's ``distributed_type`` and exports no FSDP
  setting; shardkit runs DDP and rank 0 warns, naming the flag and the file (the exact text, once per job).
- A ``MULTI_CPU`` config without mpirun starts one process, which refuses to train alone, saying how to start N.
- The config settings shardkit does not carry out raise, naming them (read from the variables the launcher
  exports; no process group needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from shardkit.integrations import _launch_config  # noqa: E402
from support import accelerate_launch_script  # noqa: E402
from support.harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "support" / "accelerate_launch_script.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")


def _launch(tmp_path: Path, config: str | None, *flags: str, script: Path = SCRIPT, script_args: tuple = (),
            timeout: float = 150) -> subprocess.CompletedProcess:
    command = [str(ACCELERATE), "launch", "--main_process_port", str(free_port()), *flags]
    if config is not None:
        path = tmp_path / "accelerate_config.yaml"
        path.write_text(config)
        command += ["--config_file", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run(command + [str(script), *script_args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path)


def _results(tmp_path: Path, config: str) -> list[dict]:
    """Each rank's report of one launch of SCRIPT (a file per rank: their stdout lines may interleave)."""
    out_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    out = _launch(tmp_path, config, script_args=(str(out_dir),))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: {kind}
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
use_cpu: {use_cpu}
"""

FSDP2_CONFIG = CONFIG.format(kind="FSDP", use_cpu="false") + """fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def test_multi_gpu_flag_starts_the_readme_example_on_two_cpu_processes_on_shardkit(tmp_path):
    out = _launch(tmp_path, None, "--multi_gpu", "--num_processes", "2",
                  script=REPO / "examples" / "accelerate_train.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "2 processes on shardkit: last gradient norm" in out.stdout


def test_an_fsdp2_config_file_makes_shardkit_shard_with_fully_shard(tmp_path, ranks):
    rows = _results(tmp_path, FSDP2_CONFIG)
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert (row["world"], row["backend"], row["strategy"]) == (2, "shardkit", "fully_shard")
        assert row["auto_wrap"] == ["Block"] and row["reshard_after_forward"] is False
        assert row["units"] == ["(root)", "0", "1"]  # each Block, then the root; the head is the root's
    # The same job with the plugin given explicitly (no FSDP in the config) trains to the same loss. This anchor only
    # supplies the loss, so it runs in harness ranks with what `accelerate launch` of a MULTI_GPU, no-mixed-precision
    # config exports to its workers (the harness sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
    out_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    env = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks.run(_explicit_plugin_job, 2, out_dir, backend=None, env=env, timeout=90)
    same = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
    assert [row["loss"] for row in same] == [row["loss"] for row in rows]


def _explicit_plugin_job(rank: int, world: int, out_dir: Path) -> None:
    from shardkit.integrations.accelerate import Accelerator, ShardkitPlugin

    plugin = ShardkitPlugin(strategy="fully_shard", auto_wrap=["Block"], reshard_after_forward=False)
    accelerate_launch_script.train(Accelerator(shardkit_plugin=plugin), out_dir)


def test_multi_gpu_with_an_fsdp_config_file_warns_that_shardkit_runs_ddp(tmp_path):
    out_dir = tmp_path / "rows"
    out_dir.mkdir()
    out = _launch(tmp_path, FSDP2_CONFIG, "--multi_gpu", "--num_processes", "2", script_args=(str(out_dir),))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
    assert [(row["world"], row["strategy"], row["units"]) for row in rows] == [(2, "ddp", [])] * 2
    warning = _launch_config.IGNORED_FSDP_WARNING.format(flag="--multi_gpu",
                                                         path=str(tmp_path / "accelerate_config.yaml"))
    assert out.stderr.count(warning) == 1, out.stderr[-5000:]


def test_the_ignored_fsdp_config_is_read_from_the_launch_command(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP2_CONFIG)
    script = str(tmp_path / "train.py")
    expected = _launch_config.IGNORED_FSDP_WARNING.format(flag="--multi_gpu", path=str(config))

    def warning(*launch_args: str, environ: dict | None = None) -> str | None:
        argv = [*launch_args, script, "--lr", "1"]
        original = sys.argv
        sys.argv = [script, "--lr", "1"]
        try:
            return _launch_config.ignored_fsdp_config(environ or {}, launcher=(argv, str(tmp_path)))
        finally:
            sys.argv = original

    assert warning("--multi_gpu", "--config_file", "fsdp.yaml") == expected  # relative to the launch's directory
    assert warning("--config-file=fsdp.yaml", "--multi-gpu", "--num_processes", "2") == expected
    assert warning("--config_file", "fsdp.yaml") is None  # the file decides: FSDP variables arrive
    assert warning("--multi_gpu", "--config_file", "fsdp.yaml",
                   environ={"ACCELERATE_USE_FSDP": "true"}) is None
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(CONFIG.format(kind="MULTI_GPU", use_cpu="false"))
    assert warning("--multi_gpu", "--config_file", str(ddp)) is None
    # accelerate's default config file, read when the launch names none
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(FSDP2_CONFIG)
    assert warning("--multi_gpu", environ={"HF_HOME": str(home)}) == expected.replace(
        str(config), str(home / "accelerate" / "default_config.yaml"))
    assert warning("--multi_gpu", environ={"HF_HOME": str(tmp_path / "nothing")}) is None


def test_a_multi_cpu_config_without_mpirun_refuses_to_train_one_process_alone(tmp_path):
    out = _launch(tmp_path, CONFIG.format(kind="MULTI_CPU", use_cpu="true"), timeout=90)
    assert out.returncode != 0
    assert "accelerate launch started this process alone" in out.stderr, out.stderr[-3000:]
    assert "accelerate launch --multi_gpu --num_processes N" in out.stderr


FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block, Other"}


def test_the_config_variables_map_onto_shardkit_plugin_options():
    assert _launch_config.plugin_options({}) is None
    assert _launch_config.plugin_options({"ACCELERATE_USE_FSDP": "false"}) is None
    assert _launch_config.plugin_options(FSDP) == {"strategy": "fully_shard", "auto_wrap": ["GPT2Block", "Other"],
                                                   "reshard_after_forward": True}
    assert _launch_config.plugin_options({**FSDP, "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}) == \
        {"strategy": "fsdp"}


@pytest.mark.parametrize("changes, message", [
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
    ({"FSDP_TRANSFORMER_CLS_TO_WRAP": ""}, "TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params: true"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing: true"),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "fsdp_sharding_strategy: SHARD_GRAD_OP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "distributed_type: DEEPSPEED"),
])
def test_config_settings_shardkit_does_not_carry_out_raise_naming_them(changes, message):
    with pytest.raises(NotImplementedError, match=message.replace("(", r"\(")):
        _launch_config.plugin_options({**FSDP, **changes})


def test_only_a_lone_process_of_a_multi_process_cpu_launch_is_refused():
    lone = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert "started this process alone" in _launch_config.launch_problem(lone)
    assert _launch_config.launch_problem({**lone, "RANK": "0"}) is None  # torchrun
    assert _launch_config.launch_problem({**lone, "OMPI_COMM_WORLD_RANK": "1"}) is None  # mpirun
    assert _launch_config.launch_problem({"ACCELERATE_USE_CPU": "True"}) is None  # one process asked for

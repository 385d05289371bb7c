"""`python -m shardkit estimate`: the ZeRO paper's memory math, the decision rule, the CLI.

The CLI runs in this process through `shardkit.__main__.main` (the entry point `python -m shardkit` calls), so each
case costs no interpreter start-up; test_cli_bad_input_subprocess keeps one real `python -m shardkit estimate`."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from shardkit import estimate
from shardkit.__main__ import main as shardkit_main
from shardkit.estimate import bytes_per_param, model_states, parse_param_count, recommend
from support.cli import shardkit_here

REPO = Path(__file__).resolve().parents[2]

ZERO_PAPER = ["--params", "7.5b", "--gpus", "64", "--precision", "fp16"]
SEVEN_B_NO_MASTER = ["--params", "7b", "--gpus", "4", "--gpu-memory-gb", "80",
                     "--precision", "bf16", "--optimizer", "adam", "--no-master-weights"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "shardkit", "estimate", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def run_here(*args: str) -> subprocess.CompletedProcess[str]:
    """`shardkit estimate ARGS` in this process (support/cli.py). A warning fails the call: in a subprocess it would
    have been a line on stderr, which the tests below assert is empty; here pytest would record it instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return shardkit_here("estimate", *args)


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Strategy name -> the numeric cells of its row (weights .. total, fits, comm)."""
    rows = {}
    for name in estimate.STRATEGIES.values():
        line = next(candidate for candidate in stdout.splitlines() if candidate.startswith(name + " "))
        rows[name] = line[len(name):].split()
    return rows


# --- bytes per parameter --------------------------------------------------------------------------

@pytest.mark.parametrize("precision, optimizer, master, expected", [
    ("fp32", "adam", True, (4, 4, 8)),
    ("fp32", "adam", False, (4, 4, 8)),  # fp32 weights are the master copy
    ("fp32", "sgd", True, (4, 4, 4)),
    ("bf16", "adam", True, (2, 2, 12)),  # the ZeRO paper's K = 12
    ("fp16", "adam", True, (2, 2, 12)),
    ("bf16", "adamw", True, (2, 2, 12)),
    ("bf16", "adam", False, (2, 2, 8)),
    ("bf16", "sgd", True, (2, 2, 8)),
    ("bf16", "sgd", False, (2, 2, 4)),
])
def test_bytes_per_param(precision, optimizer, master, expected):
    bpp = bytes_per_param(precision, optimizer, master)
    assert (bpp.weights, bpp.grads, bpp.optimizer) == expected
    assert bpp.total == sum(expected)


# --- the two reference tables ---------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_zero_paper_7_5b_on_64_gpus(precision):
    # ZeRO paper, figure 1 / section 3: Psi = 7.5B, N = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    states = model_states(7_500_000_000, 64, precision, "adam", master_weights=True)
    assert states["ddp"].total_gb == 120.0
    assert states["zero1"].total_gb == 31.40625
    assert states["zero2"].total_gb == 16.640625
    assert states["zero3"].total_gb == 1.875
    assert states["zero3"].total_bytes == 1_875_000_000
    assert states["ddp"].optimizer_gb == 90.0  # K * Psi = 12 * 7.5e9


def test_7b_on_4_gpus_bf16_adam_without_master():
    states = model_states(7_000_000_000, 4, "bf16", "adam", master_weights=False)
    ddp = states["ddp"]
    assert (ddp.weights_gb, ddp.grads_gb, ddp.optimizer_gb) == (14.0, 14.0, 56.0)
    totals = [states[k].total_gb for k in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == [84.0, 42.0, 31.5, 21.0]
    offload = states["zero3_offload"]
    assert (offload.total_gb, offload.optimizer_gb, offload.cpu_gb) == (7.0, 0.0, 14.0)


def test_zero_paper_table_printed():
    result = run_here(*ZERO_PAPER)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    totals = [rows[estimate.STRATEGIES[k]][4] for k in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == ["120.0", "31.4", "16.6", "1.9"]
    assert rows["DDP"][:3] == ["15.0", "15.0", "90.0"]


def test_7b_table_printed():
    result = run_here(*SEVEN_B_NO_MASTER)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    rows = table_rows(result.stdout)
    #                         weights grads  optim  act    total   fits   comm
    assert rows["DDP"] == ["14.0", "14.0", "56.0", "0.0", "84.0", "no", "2x", "=", "28.0", "GB"]
    assert rows["ZeRO-1"][:6] == ["14.0", "14.0", "14.0", "0.0", "42.0", "yes"]
    assert rows["ZeRO-2"][:6] == ["14.0", "3.5", "14.0", "0.0", "31.5", "yes"]
    assert rows["ZeRO-3 / FULL_SHARD"] == ["3.5", "3.5", "14.0", "0.0", "21.0", "yes",
                                           "3x", "=", "42.0", "GB"]
    assert rows["ZeRO-3 + CPU offload"][:6] == ["3.5", "3.5", "0.0", "0.0", "7.0", "yes"]
    assert "recommended: ZeRO-2" in result.stdout
    assert "14.0 GB of optimizer state per GPU in host RAM" in result.stdout


# --- communication and activations ----------------------------------------------------------------

def test_communication_volume():
    states = model_states(1_000_000_000, 8, "bf16")
    assert [s.comm_factor for s in states.values()] == [2, 2, 2, 3, 3]
    assert states["ddp"].comm_bytes == 2 * 2 * 1_000_000_000  # 2 Psi elements at 2 bytes
    assert states["zero3"].comm_gb == 6.0
    assert model_states(1_000_000_000, 8, "fp32")["ddp"].comm_gb == 8.0


def test_activations_are_added_to_every_strategy():
    base = model_states(7_000_000_000, 4, master_weights=False)
    with_act = model_states(7_000_000_000, 4, master_weights=False, activation_gb=10)
    for key in estimate.STRATEGIES:
        assert with_act[key].total_gb == base[key].total_gb + 10
        assert with_act[key].activation_gb == 10


# --- decision rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("params, gpus, gpu_gb, activation_gb, expected", [
    (124_439_808, 8, 80, 0, "ddp"),            # gpt2: 2.0 GB, fits anywhere
    (7_000_000_000, 4, 84, 0, "ddp"),          # DDP needs exactly 84 GB: fits
    (7_000_000_000, 4, 80, 0, "zero2"),        # DDP 84 > 80, ZeRO-2 31.5
    (7_000_000_000, 4, 24, 0, "zero3"),        # ZeRO-2 31.5 > 24, ZeRO-3 21
    (7_000_000_000, 4, 24, 5, "zero3_offload"),  # ZeRO-3 26 > 24, offload 12
    (7_000_000_000, 1, 24, 0, None),           # offload needs 28 GB on one GPU
])
def test_recommend(params, gpus, gpu_gb, activation_gb, expected):
    states = model_states(params, gpus, "bf16", "adam", master_weights=False,
                          activation_gb=activation_gb)
    assert recommend(states, gpu_gb) == expected


def test_recommend_never_picks_zero1_and_respects_headroom():
    states = model_states(7_000_000_000, 4, master_weights=False)
    assert recommend(states, 42) == "zero2"  # ZeRO-1 fits too, but ZeRO-2 is cheaper
    assert recommend(states, 84, headroom_gb=0) == "ddp"
    assert recommend(states, 84, headroom_gb=1) == "zero2"


def test_cli_says_when_nothing_fits(capsys):
    assert shardkit_main(["estimate", "--params", "70b", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: none - does not fit" in out
    assert [row[5] for row in table_rows(out).values()] == ["no"] * 5


# 7b, bf16 + Adam without master weights, 4 GPUs: DDP 84.0, ZeRO-2 31.5, ZeRO-3 21.0, offload 7.0 GB/GPU.
@pytest.mark.parametrize("gpus, gpu_gb, activation_gb, headroom_gb, line", [
    (4, 84, 0, 0, "recommended: DDP (84.0 GB/GPU within 84 GB) - the model states fit on every GPU; "
                  "no sharding needed"),
    (4, 80, 0, 0, "recommended: ZeRO-2 / FSDP SHARD_GRAD_OP (31.5 GB/GPU within 80 GB) - DDP does not fit "
                  "(84.0 GB/GPU)"),
    (4, 84, 0, 1, "recommended: ZeRO-2 / FSDP SHARD_GRAD_OP (31.5 GB/GPU within 84 GB - 1 GB headroom) - "
                  "DDP does not fit (84.0 GB/GPU)"),
    (4, 24, 0, 0, "recommended: ZeRO-3 / FSDP FULL_SHARD (21.0 GB/GPU within 24 GB) - ZeRO-2 does not fit "
                  "(31.5 GB/GPU)"),
    (4, 24, 5, 0, "recommended: ZeRO-3 + CPU offload (12.0 GB/GPU within 24 GB) - ZeRO-3 / FULL_SHARD does "
                  "not fit (26.0 GB/GPU)"),
    (1, 24, 0, 0, "recommended: none - does not fit: even ZeRO-3 + CPU offload needs 28.0 GB/GPU, more "
                  "than 24 GB; add GPUs or reduce activations."),
])
def test_recommendation_line_gives_each_strategy_its_own_figure(gpus, gpu_gb, activation_gb, headroom_gb,
                                                                 line):
    report = estimate.format_report(7_000_000_000, gpus, gpu_gb, "bf16", "adam", master_weights=False,
                                    activation_gb=activation_gb, headroom_gb=headroom_gb)
    assert report.splitlines()[-1] == line


def test_recommendation_figures_match_the_table():
    # A new user's run (issue #12): the figure after "ZeRO-2 does not fit" was the chosen ZeRO-3's.
    result = run_here("--params", "7b", "--gpus", "8", "--gpu-memory-gb", "24")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows["ZeRO-2"][4] == "26.2" and rows["ZeRO-3 / FULL_SHARD"][4] == "14.0"
    assert result.stdout.splitlines()[-1] == (
        "recommended: ZeRO-3 / FSDP FULL_SHARD (14.0 GB/GPU within 24 GB) - ZeRO-2 does not fit (26.2 GB/GPU)"
    )


def test_gpus_defaults_to_one(capsys):
    assert shardkit_main(["estimate", "--params", "7b"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "7,000,000,000 parameters, 1 GPU(s) x 80 GB, bf16 mixed precision, with fp32 master weights, adam"
    )
    assert table_rows(out)["ZeRO-3 / FULL_SHARD"][4] == "112.0"  # 16 bytes x 7e9 on one GPU


# --- parameter counts -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("7b", 7_000_000_000),
    ("7B", 7_000_000_000),
    ("7e9", 7_000_000_000),
    ("7.5b", 7_500_000_000),
    ("1.5b", 1_500_000_000),
    ("124M", 124_000_000),
    ("70b", 70_000_000_000),
    ("1t", 1_000_000_000_000),
    ("350k", 350_000),
    ("6_738_415_616", 6_738_415_616),
    (" 13b ", 13_000_000_000),
    ("gpt2", 124_439_808),
    ("gpt2-xl", 1_557_611_200),
    ("llama-7b", 6_738_415_616),
    ("LLaMA-13B", 13_015_864_320),
    ("llama2-70b", 68_976_648_192),
    ("zero-paper-7.5b", 7_500_000_000),
])
def test_parse_param_count(text, expected):
    assert parse_param_count(text) == expected


@pytest.mark.parametrize("text", ["0", "0b", "-7b", "1.5", "foo", "", "7bb", "b", "inf", "nan",
                                  "7 b"])
def test_parse_param_count_rejects(text):
    with pytest.raises(ValueError):
        parse_param_count(text)


PRESET_LIST = "gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b, llama-13b, llama2-70b, zero-paper-7.5b"


@pytest.mark.parametrize("text, closest", [
    ("gpt2-meduim", "gpt2-medium"),
    ("GPT-2", "gpt2"),
    ("gpt2xl", "gpt2-xl"),
    ("llama-9b", "llama-7b"),
    (" llama-13 ", "llama-13b"),
    ("zero-7.5b", "zero-paper-7.5b"),
])
def test_unknown_preset_suggests_the_closest(text, closest):
    with pytest.raises(ValueError) as error:
        parse_param_count(text)
    assert str(error.value) == (
        f"unknown model {text!r}: did you mean {closest}? (presets: {PRESET_LIST}; "
        "or a number like 7e9, 7b, 1.5b, 124M)"
    )


@pytest.mark.parametrize("text", ["foo", "7bb", "b"])
def test_unknown_name_far_from_every_preset(text):
    with pytest.raises(ValueError) as error:
        parse_param_count(text)
    assert str(error.value) == (
        f"unknown model or parameter count {text!r}: use a number like 7e9, 7b, 1.5b, 124M "
        f"or a preset ({PRESET_LIST})"
    )


@pytest.mark.parametrize("kwargs", [
    dict(num_params=0, num_gpus=4),
    dict(num_params=-7, num_gpus=4),
    dict(num_params=7e9, num_gpus=0),
    dict(num_params=7.5, num_gpus=4),
    dict(num_params=7e9, num_gpus=True),
    dict(num_params=7e9, num_gpus=4, precision="fp8"),
    dict(num_params=7e9, num_gpus=4, optimizer="lion"),
    dict(num_params=7e9, num_gpus=4, activation_gb=-1),
    dict(num_params=7e9, num_gpus=4, activation_gb=float("nan")),
])
def test_model_states_rejects(kwargs):
    with pytest.raises(ValueError):
        model_states(**kwargs)


# --- bad command lines: one line on stderr, exit code 2 -------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["--params", "7b", "--gpus", "0"], "--gpus"),
    (["--params", "7b", "--gpus", "-1"], "--gpus"),
    (["--params", "7b", "--gpus", "two"], "--gpus"),
    (["--params", "0", "--gpus", "4"], "--params"),
    (["--params=-7b", "--gpus", "4"], "--params"),
    (["--params", "llama-9b", "--gpus", "4"], "--params"),
    (["--params", "7b", "--gpus", "4", "--gpu-memory-gb", "0"], "--gpu-memory-gb"),
    (["--params", "7b", "--gpus", "4", "--activation-gb", "-2"], "--activation-gb"),
    (["--params", "7b", "--gpus", "4", "--precision", "fp8"], "--precision"),
    (["--params", "7b", "--gpus", "4", "--optimizer", "lion"], "--optimizer"),
    (["--params", "7b", "--gpus", "4", "--headroom-gb", "x"], "--headroom-gb"),
])
def test_cli_bad_input(args, flag, capsys):
    # In-process through the same entry point as `python -m shardkit` (one subprocess test below).
    with pytest.raises(SystemExit) as exit_info:
        shardkit_main(["estimate", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shardkit estimate: error: argument " + flag)


def test_cli_bad_input_subprocess():
    result = run_cli("--params", "7b", "--gpus", "0")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "shardkit estimate: error: argument --gpus: must be a positive integer, got '0'\n"
    )


def test_cli_suggests_a_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        shardkit_main(["estimate", "--params", "gpt2-meduim"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "shardkit estimate: error: argument --params: unknown model 'gpt2-meduim': did you mean "
        f"gpt2-medium? (presets: {PRESET_LIST}; or a number like 7e9, 7b, 1.5b, 124M)\n"
    )


def test_cli_missing_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        shardkit_main(["estimate", "--gpus", "4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "shardkit estimate: error: the following arguments are required: --params\n"
    )


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        shardkit_main(["estimate", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines at the terminal width
    assert "--no-master-weights" in out and "llama-7b (6,738,415,616)" in out
    assert "--gpus N number of GPUs (data-parallel world size; default: 1, like torchrun's --nproc-per-node)" in out


def test_estimate_module_is_pure_stdlib():
    # Loaded from its file, so the package __init__ (torch, the C extension) is not run.
    path = str(REPO / "python" / "shardkit" / "estimate.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('est', {path!r})\n"
        "module = sys.modules['est'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""``python -m shardkit scale`` (issue #12) on examples/train_gpt.py: a table and a PNG of throughput, scaling
efficiency and memory per (strategy, world size), and a failed run reported, not hidden.

What each can catch: efficiency not relative to the same strategy's one-rank run, memory read from the wrong
rank or run (FSDP at 2 ranks must hold half of what it holds alone), runs that fail silently.

The CLI runs in the pytest process through `shardkit.__main__.main` where only its output matters (its torchrun
jobs stay real processes); the failing-run test keeps a real `python -m shardkit scale`, whose interpreter's exit
code is what it asserts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import shardkit_here

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = ["--steps", "4", "--layers", "2", "--d-model", "64", "--vocab", "512", "--seq", "16"]


def _scale(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", "scale", "--worlds", "1", "2", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=400)


def _scale_here(out: Path, *args: str) -> subprocess.CompletedProcess:
    """_scale's command through the entry point `python -m shardkit` calls, in this process (its torchrun jobs are
    still launched)."""
    return shardkit_here("scale", "--worlds", "1", "2", "--out", str(out), *args)


@pytest.mark.timeout(420)
def test_scale_reports_throughput_efficiency_and_memory(tmp_path: Path):
    done = _scale_here(tmp_path, "--strategies", "ddp", "fsdp", "--", str(EXAMPLE), *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["strategy", "world", "tokens/s", "efficiency", "held", "MiB/rank", "peak", "RSS", "MiB"]
    assert [line.split()[:2] for line in lines[1:5]] == [["ddp", "1"], ["ddp", "2"], ["fsdp", "1"], ["fsdp", "2"]]
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    by = {(row["strategy"], row["world"]): row for row in rows}
    assert by[("ddp", 1)]["efficiency"] == 1.0 and by[("fsdp", 1)]["efficiency"] == 1.0
    for key in (("ddp", 2), ("fsdp", 2)):
        row = by[key]
        assert row["efficiency"] == pytest.approx(row["tokens_per_s"] / (2 * by[(key[0], 1)]["tokens_per_s"]))
    # The same threads per rank at every world size (torchrun alone gives a one-rank job every core): cores / 2.
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert {row["threads"] for row in rows} == {threads}, rows
    assert f"threads per rank: {threads} (OMP_NUM_THREADS, the same at every world size)" in done.stdout
    assert by[("ddp", 2)]["held_bytes"] == by[("ddp", 1)]["held_bytes"]  # DDP replicates
    assert by[("fsdp", 2)]["held_bytes"] == pytest.approx(by[("fsdp", 1)]["held_bytes"] / 2, rel=0.02)  # sharded
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional: the tests' venv may lack it
        assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not (tmp_path / "scale.png").exists()
        assert done.stdout.rstrip().endswith("(no matplotlib: no plot)"), done.stdout


# A training script that fails as train_gpt.py does on a bad flag (argparse's exit code and message), without
# importing torch in each worker first.
FAILING = """
import argparse
parser = argparse.ArgumentParser(prog="train")
parser.add_argument("--hook", choices=["none", "powersgd"])
parser.parse_args(["--hook", "nonsense"])
"""


@pytest.mark.timeout(200)
def test_a_failing_run_is_reported_and_the_exit_code_says_so(tmp_path: Path):
    # A real `python -m shardkit scale`: the exit code asserted is the interpreter's (`sys.exit(main())`).
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    done = _scale(tmp_path, "--strategies", "ddp", "--", str(script))
    assert done.returncode == 1
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert [row["world"] for row in rows] == [1, 2]
    assert all("exit code" in row["error"] and "--hook: invalid choice: 'nonsense'" in row["error"] for row in rows)
    assert "ddp            1  failed: exit code" in done.stdout


SUPERLINEAR = """
import json, os
world = int(os.environ["WORLD_SIZE"])
if os.environ["RANK"] == "0":
    for step in range(3):  # throughput that grows as world squared: efficiency 2.0 at world 2
        print(json.dumps({"tokens_per_s": 100.0 * world * world}))
"""


@pytest.mark.timeout(200)
def test_an_efficiency_out_of_range_is_warned_about(tmp_path: Path):
    script = tmp_path / "superlinear.py"
    script.write_text(SUPERLINEAR)
    done = _scale_here(tmp_path, "--threads-per-rank", "1", "--", str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("shardkit scale: warning: efficiency 2.00 at world 2 is outside [0, 1.1]: the runs did not do the same "
            "work per rank") in done.stderr, done.stderr[-2000:]
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert "warning" not in rows[0] and rows[1]["efficiency"] == 2.0 and "outside [0, 1.1]" in rows[1]["warning"]
    assert "2.00!" in done.stdout.splitlines()[2], done.stdout

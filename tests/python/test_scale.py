"""``python -m shardkit scale`` (issue #12) on examples/train_gpt.py: a table and a PNG of throughput, scaling
efficiency and memory per (strategy, world size), and a failed run reported, not hidden.

What each can catch: efficiency not relative to the same strategy's one-rank run, memory read from the wrong
rank or run (FSDP at 2 ranks must hold half of what it holds alone), runs that fail silently.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = ["--steps", "4", "--layers", "2", "--d-model", "64", "--vocab", "512", "--seq", "16"]


def _scale(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", "scale", "--worlds", "1", "2", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(420)
def test_scale_reports_throughput_efficiency_and_memory(tmp_path: Path):
    done = _scale(tmp_path, "--strategies", "ddp", "fsdp", "--", str(EXAMPLE), *TINY)
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
    assert by[("ddp", 2)]["held_bytes"] == by[("ddp", 1)]["held_bytes"]  # DDP replicates
    assert by[("fsdp", 2)]["held_bytes"] == pytest.approx(by[("fsdp", 1)]["held_bytes"] / 2, rel=0.02)  # sharded
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional: the tests' venv may lack it
        assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not (tmp_path / "scale.png").exists()
        assert done.stdout.rstrip().endswith("(no matplotlib: no plot)"), done.stdout


@pytest.mark.timeout(200)
def test_a_failing_run_is_reported_and_the_exit_code_says_so(tmp_path: Path):
    done = _scale(tmp_path, "--strategies", "ddp", "--", str(EXAMPLE), *TINY, "--hook", "nonsense")
    assert done.returncode == 1
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert [row["world"] for row in rows] == [1, 2]
    assert all("exit code" in row["error"] and "--hook: invalid choice: 'nonsense'" in row["error"] for row in rows)
    assert "ddp            1  failed: exit code" in done.stdout

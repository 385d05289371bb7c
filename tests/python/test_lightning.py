"""shardkit under Lightning as it is: ``DDPStrategy(process_group_backend="shardkit")`` (tests/python/
lightning_script.py under torchrun, 2 ranks) trains exactly as the same script on gloo, every rank ends with the
same weights, and the job really ran on shardkit's process group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lightning")

from harness import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).parent / "lightning_script.py"


def _fit(directory: Path, backend: str) -> dict[str, np.ndarray]:
    result = directory / f"{backend}.npz"
    proc = run_torchrun(SCRIPT, 2, backend, str(result), timeout=240, cwd=directory)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    with np.load(result) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.timeout(500)
def test_ddp_strategy_with_the_shardkit_backend_trains_as_on_gloo(tmp_path: Path):
    ours, theirs = _fit(tmp_path, "shardkit"), _fit(tmp_path, "gloo")
    assert str(ours["backend"]) == "shardkit" and str(theirs["backend"]) == "gloo"
    assert ours["ranks_agree"] and theirs["ranks_agree"] and int(ours["world"]) == 2
    weights = [k for k in theirs if k not in ("backend", "ranks_agree", "world") and not k.startswith("initial/")]
    assert weights == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"], weights
    for name in weights:  # two ranks' sums have one order: bitwise
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        assert not np.array_equal(ours[name], ours[f"initial/{name}"]), f"{name} did not train"

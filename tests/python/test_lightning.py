"""shardkit under Lightning as it is: ``DDPStrategy(process_group_backend="shardkit")`` (tests/python/
lightning_script.py under torchrun, 2 ranks) trains exactly as the same script on gloo, on one host and on two
simulated hosts; every rank ends with the same weights, and the job really ran on shardkit's process group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lightning")

from support.harness import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).parent / "support" / "lightning_script.py"


def _fit(directory: Path, backend: str, *placement: str) -> dict[str, np.ndarray]:
    result = directory / f"{backend}{''.join(placement)}.npz"
    proc = run_torchrun(SCRIPT, 2, backend, str(result), *placement, timeout=240, cwd=directory)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    with np.load(result) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def on_gloo(tmp_path_factory) -> dict[str, np.ndarray]:
    return _fit(tmp_path_factory.mktemp("gloo"), "gloo")


@pytest.mark.timeout(500)
@pytest.mark.parametrize("placement", [(), ("one_host_per_rank",)], ids=["one_host", "2_simulated_hosts"])
def test_ddp_strategy_with_the_shardkit_backend_trains_as_on_gloo(tmp_path: Path, on_gloo, placement):
    ours, theirs = _fit(tmp_path, "shardkit", *placement), on_gloo
    assert str(ours["backend"]) == "shardkit" and str(theirs["backend"]) == "gloo"
    assert ours["ranks_agree"] and theirs["ranks_agree"] and int(ours["world"]) == 2
    assert int(ours["hosts"]) == (2 if placement else 1)
    weights = [k for k in theirs if k not in ("backend", "ranks_agree", "world", "hosts") and not k.startswith("initial/")]
    assert weights == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"], weights
    for name in weights:  # two ranks' sums have one order: bitwise
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        assert not np.array_equal(ours[name], ours[f"initial/{name}"]), f"{name} did not train"

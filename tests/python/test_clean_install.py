"""A clean install trains: the shardkit wheel in a venv that holds only torch, as the README's Install section and
docs/install.md say.

`make clean-venv` (run here, so `make test` covers it; a no-op when nothing changed) builds the wheel with
`pip wheel --no-build-isolation --no-deps` into build/wheel and installs it into build/clean-venv, a venv
holding only torch==2.13.0 — no numpy, no pytest. Then, with that venv's interpreter and from a directory
outside the source tree (so the checkout cannot be imported), both examples and clean_install_steps.py
(shardkit DDP, ZeRO-1 and ZeRO-2 against torch's DDP) run under torchrun.

What it catches: anything shardkit needs at run time that a user's install lacks — numpy above all (torch's
object collectives unpickle through Tensor.numpy(), which raised "Numpy is not available" in DDP's and
ZeRO's constructors before shardkit._exchange), test-only packages, or files of the checkout that the wheel
does not ship.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from support import harness

REPO = Path(__file__).resolve().parents[2]
CLEAN_VENV = REPO / "build" / "clean-venv"
WHEEL_DIR = REPO / "build" / "wheel"  # where `make clean-venv` builds the wheel
# The first run builds the wheel (a full compile) and installs torch into the venv: minutes on 2 cores.
SETUP_TIMEOUT_S = 1500
JOB_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(SETUP_TIMEOUT_S + JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def clean_python() -> Path:
    """build/clean-venv's interpreter, after `make clean-venv` brought the venv and the wheel up to date."""
    # Called from `make test`, the outer make's job-server settings must not leak into this one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(["make", "--no-print-directory", "clean-venv"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    assert result.returncode == 0, f"make clean-venv failed:\n{result.stdout}\n{result.stderr}"
    return CLEAN_VENV / "bin" / "python"


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory outside the checkout, and no PYTHONPATH that could lead back into it."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return tmp_path


def torchrun(clean_python: Path, outside: Path, script: Path, *args: str) -> str:
    result = harness.run_torchrun(script, 2, *args, timeout=JOB_TIMEOUT_S, python=clean_python, cwd=outside)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_the_venv_has_torch_and_the_wheel_but_no_numpy(clean_python, outside):
    probe = ("import importlib.util, torch, shardkit; "
             "print(importlib.util.find_spec('numpy'), importlib.util.find_spec('pytest')); "
             "print(torch.__version__); print(shardkit.__file__)")
    result = subprocess.run([str(clean_python), "-c", probe], cwd=outside, capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    missing, torch_version, shardkit_file = result.stdout.splitlines()
    assert missing == "None None"  # else this module proves nothing about a clean install
    assert torch_version.startswith("2.13.0")
    assert Path(shardkit_file).is_relative_to(CLEAN_VENV / "lib"), shardkit_file  # the wheel, not the checkout


# What a process that only imports torch knows of shardkit, then what making a group on the backend loads. JSON out.
AUTOLOAD_PROBE = """
import json, sys
import torch
import torch.distributed as dist

def native():
    with open("/proc/self/maps") as maps:
        return any("shardkit" in line and "_C." in line for line in maps)

seen = {"registered": "shardkit" in dist.Backend.backend_list, "native": native(),
        "modules": sorted(m for m in sys.modules if "shardkit" in m),
        "slurm": "slurm" in sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers}
try:  # a device map, as users write one beside NCCL (gloo for CUDA here: this torch has no NCCL)
    dist.init_process_group("cpu:shardkit,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
except Exception as error:  # torch 2.13: AssertionError("Unknown c10d backend type SHARDKIT")
    seen["error"] = f"{type(error).__name__}: {error}"
else:
    t = torch.arange(4.0)
    dist.all_reduce(t)
    seen.update(backend=type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__, result=t.tolist(),
                native_after=native())
    dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_backend_shardkit_needs_no_import_and_loads_nothing_until_a_group_is_made(clean_python, outside):
    """torch's extension autoloading (the wheel's "torch.backends" entry point): `import torch` alone makes
    backend="shardkit" (in a device map too) and the slurm:// rendezvous known, loading only the registering module;
    the first group on it loads the extension. With TORCH_DEVICE_BACKEND_AUTOLOAD=0 torch loads nothing of
    shardkit's and refuses the name, naming it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    seen = {}
    for autoload in ("1", "0"):
        result = subprocess.run([str(clean_python), "-c", AUTOLOAD_PROBE], cwd=outside, capture_output=True, text=True,
                                env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}, timeout=JOB_TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-2000:]
        seen[autoload] = json.loads(result.stdout.splitlines()[-1])
    assert seen["1"] == {"registered": True, "modules": ["_shardkit_autoload"], "native": False, "slurm": True,
                         "backend": "ProcessGroupShardkit", "result": [0.0, 1.0, 2.0, 3.0], "native_after": True}, \
        seen["1"]
    error = seen["0"].pop("error", "")
    assert seen["0"] == {"registered": False, "modules": [], "native": False, "slurm": False}, seen["0"]
    assert "shardkit" in error.lower(), error  # torch 2.13: "Unknown c10d backend type SHARDKIT"


def test_the_wheel_ships_the_license_py_typed_and_the_extension_stub(clean_python):
    (wheel,) = WHEEL_DIR.glob("shardkit-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"shardkit/py.typed", "shardkit/_C.pyi", "shardkit-0.2.0.dist-info/licenses/LICENSE"} <= names, \
        sorted(names)


def test_training_example(clean_python, outside):
    out = torchrun(clean_python, outside, REPO / "examples" / "train_ddp.py", "--steps", "60")
    assert "2 ranks, 60 steps in" in out and "replicas identical: True" in out, out
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], losses


def test_gpt_example_with_auto(clean_python, outside):
    """The showcase needs nothing but torch and the wheel: auto and the memory table. (Its checkpoints do not:
    torch.distributed.checkpoint's gather_object converts through numpy, and the example says so.)"""
    tiny = ["--steps", "3", "--layers", "2", "--d-model", "64", "--vocab", "512", "--seq", "16"]
    out = torchrun(clean_python, outside, REPO / "examples" / "train_gpt.py", *tiny)
    assert "strategy auto -> ddp" in out and "held/estimate" in out, out
    # Refused by its argument parsing, before any process group: a plain interpreter shows it (no torchrun agent).
    refused = subprocess.run([str(clean_python), str(REPO / "examples" / "train_gpt.py"), *tiny, "--checkpoint",
                              str(outside / "c")], cwd=outside, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert refused.returncode != 0
    assert "--checkpoint/--resume/--checkpoint-dir need numpy: torch.distributed.checkpoint exchanges" in refused.stderr


def test_quickstart(clean_python, outside):
    out = torchrun(clean_python, outside, REPO / "examples" / "quickstart.py")
    assert out.splitlines()[-1] == "2 ranks: all_reduce AVG = 0.5; 5 DDP steps done", out


def test_collectives_demo(clean_python, outside):
    out = torchrun(clean_python, outside, REPO / "examples" / "collectives_demo.py")
    assert "shardkit demo: 2 ranks, allreduce/allgather/broadcast all correct" in out, out


def test_ddp_zero_and_fsdp_steps_match_torch_ddp(clean_python, outside):
    out = torchrun(clean_python, outside, Path(__file__).parent / "support" / "clean_install_steps.py")
    lines = set(out.splitlines())
    assert f"shardkit from {CLEAN_VENV}" in out, out
    expected = {f"rank 1: zero_stage={stage}: parameters match torch DDP after 3 steps" for stage in (0, 1, 2)}
    expected.add("rank 0: zero_stage=0: parameters match torch DDP after 3 steps")
    expected |= {f"rank {rank}: FullyShardedDataParallel: parameters match torch DDP after 3 steps" for rank in (0, 1)}
    expected |= {f"rank 0: zero_stage={stage}: parameters and consolidated optimizer state match torch DDP "
                 f"after 3 steps" for stage in (1, 2)}
    assert expected <= lines, out


@pytest.fixture(scope="module")
def integration_imports(clean_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each integration imported in turn by one process of the clean venv (one interpreter start-up for the three;
    a failed import leaves nothing behind in sys.modules): module -> the exception it raised, as its traceback's
    last line reads, or "imported"."""
    code = ("import json\nseen = {}\nfor module in ('accelerate', 'transformers', 'lightning'):\n"
            "    try:\n        __import__(f'shardkit.integrations.{module}')\n        seen[module] = 'imported'\n"
            "    except BaseException as error:\n        seen[module] = f'{type(error).__name__}: {error}'\n"
            "print(json.dumps(seen))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing leads back into the checkout
    result = subprocess.run([str(clean_python), "-c", code], cwd=tmp_path_factory.mktemp("outside"), env=env,
                            capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module,needs", [("accelerate", "Hugging Face accelerate (pip install accelerate"),
                                          ("transformers", "Hugging Face transformers and accelerate (pip install"),
                                          ("lightning", "Lightning (pip install lightning")])
def test_an_integration_without_its_library_says_what_to_install(integration_imports, module, needs):
    """The integrations' examples need their library; without it the import names what to install (and
    ``import shardkit`` itself never reaches them)."""
    assert integration_imports[module].startswith(f"ImportError: shardkit.integrations.{module} needs {needs}"), \
        integration_imports

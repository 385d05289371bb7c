"""What shardkit's extension autoloading adds to ``import torch`` (python/_shardkit_autoload.py).

    python benchmarks/autoload.py              # 15 rounds (about a minute)
    python benchmarks/autoload.py --rounds 5

``import torch`` calls every entry of the ``torch.backends`` entry-point group as its last step (unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); shardkit's entry registers the backend's name and loads nothing else. Measured in
fresh interpreters of this venv, per round:

- the entry's own cost: in a process that imported torch with autoloading off, the time to load shardkit's entry
  point and call it (what autoloading adds for shardkit), and the modules that appeared meanwhile (only
  ``_shardkit_autoload`` may: no shardkit package, no extension);
- torch's scan of the group (``importlib.metadata.entry_points(group="torch.backends")``), in the same process: torch
  pays it at every ``import torch`` with autoloading on, whatever is installed;
- ``import torch`` as a whole with autoloading on and off, in two fresh interpreters per round (the order alternates
  by round): the end-to-end difference, noisier than the parts above (an import of torch takes seconds here).

Medians over rounds. Results: ``benchmarks/results/autoload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks folder is not a package
from _harness import RESULTS_DIR, ForeignLoad, add_target, header, load_note, machine_info, write_json, wrote  # noqa: E402

ENTRY_LIMIT_MS = 5.0

# In a fresh interpreter, torch imported with autoloading off: time torch's scan, then shardkit's entry.
PARTS = """
import json, sys, time
import torch
from importlib.metadata import entry_points
t0 = time.perf_counter()
entries = entry_points(group="torch.backends")
t1 = time.perf_counter()
(entry,) = [e for e in entries if e.name == "shardkit"]
before = set(sys.modules)
t2 = time.perf_counter()
entry.load()()
t3 = time.perf_counter()
import torch.distributed as dist
print(json.dumps({"scan_ms": 1e3 * (t1 - t0), "entry_ms": 1e3 * (t3 - t2),
                  "new_modules": sorted(set(sys.modules) - before),
                  "registered": "shardkit" in dist.Backend.backend_list}))
"""
WHOLE = "import time; t0 = time.perf_counter(); import torch; print(1e3 * (time.perf_counter() - t0))"


def run(code: str, autoload: str) -> str:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"autoload.py: a probe failed:\n{result.stderr[-3000:]}")
    return result.stdout.splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    machine = machine_info()
    print(header("autoload: what shardkit's torch.backends entry adds to import torch", machine,
                 f"{args.rounds} rounds"))
    parts: list[dict[str, Any]] = []
    whole: dict[str, list[float]] = {"on": [], "off": []}
    with ForeignLoad() as load:
        for r in range(args.rounds):
            parts.append(json.loads(run(PARTS, "0")))
            for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
                whole[setting].append(float(run(WHOLE, "1" if setting == "on" else "0")))
    new_modules = sorted({m for p in parts for m in p["new_modules"]})
    if not all(p["registered"] for p in parts):
        raise RuntimeError("autoload.py: the entry point did not register the backend")
    summary = {"entry_ms": statistics.median(p["entry_ms"] for p in parts),
               "scan_ms": statistics.median(p["scan_ms"] for p in parts),
               "import_torch_on_ms": statistics.median(whole["on"]),
               "import_torch_off_ms": statistics.median(whole["off"]),
               "modules_the_entry_loads": new_modules}
    print(f"shardkit's entry (load + register): {summary['entry_ms']:.2f} ms, loading {new_modules}; torch's scan of "
          f"the group: {summary['scan_ms']:.2f} ms; import torch {summary['import_torch_on_ms']:.0f} ms with "
          f"autoloading, {summary['import_torch_off_ms']:.0f} ms without")
    note = load_note(load.cores, machine, "the run")
    if note:
        print(note)
    checks: list[dict[str, Any]] = []
    add_target(checks, "shardkit's torch.backends entry: load + register, added to import torch", summary["entry_ms"],
               ENTRY_LIMIT_MS, False, " ms")
    add_target(checks, "modules the entry loads besides _shardkit_autoload (0: no shardkit package, no extension)",
               len([m for m in new_modules if m != "_shardkit_autoload"]), 0, False, "")
    path = write_json(RESULTS_DIR / "autoload.json", {"machine": machine, "rounds": args.rounds, "summary": summary,
                                                      "parts": parts, "import_torch_ms": whole,
                                                      "foreign_load_cores": load.cores, "targets": checks})
    print(wrote(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmarks' GPT is the example's (examples/gpt_model.py): one definition for both."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt_model import GPT, QUICK_MODEL, Block, ModelConfig, n_params  # noqa: E402,F401

"""This process's random number generators' states as tensors, and back: torch's CPU generator, CUDA's (every
visible device's, where CUDA is available), Python's ``random`` and numpy's global generator (where numpy is
installed).

Tensors only (DCP stores them as tensors; nothing here is pickled): Python's Mersenne Twister state is its 625
words as int64 and its cached Gaussian as float64 ``[has, value]``; numpy's the same with ``[pos, has_gauss,
cached_gaussian]``. Each rank's states differ, so the checkpointer keys them by rank (_checkpointer.py).
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import torch


def capture() -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()
    if version != 3:
        raise NotImplementedError(f"shardkit checkpoint: Python's random state version {version} (this shardkit "
                                  "saves version 3, CPython's Mersenne Twister)")
    state = {"torch": torch.get_rng_state(),
             "python": torch.tensor(words, dtype=torch.int64),
             "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if name != "MT19937":
            raise NotImplementedError(f"shardkit checkpoint: numpy's global generator is {name}; this shardkit "
                                      "saves MT19937's state")
        state["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
        state["numpy_misc"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return state


def restore(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        has, value = state["python_gauss"].tolist() if "python_gauss" in state else (0.0, 0.0)
        random.setstate((3, tuple(int(w) for w in state["python"].tolist()), value if has else None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy_keys" in state:
        import numpy as np

        pos, has_gauss, cached = state["numpy_misc"].tolist()
        np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                             cached))

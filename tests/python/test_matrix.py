"""The everyday matrix (support/matrix.py): every front × the settings users turn on next × every entry point,
each cell against the same configuration on torch's own wrapper on gloo.

``make test`` runs the pairwise cover (every pair of values of every two settings at least once, per front and
entry point); ``make matrix`` (SHARDKIT_MATRIX=whole) runs every combination. The front is one of each entry point's
dimensions, so every front meets every setting; one launch per entry point runs all of its cells. A cell passes
when shardkit's run matches the anchor's (losses, clipped norms, evaluation, state dicts, the final parameters),
or, for a combination listed in ``matrix.UNSUPPORTED``, when shardkit raises exactly that error.
"""

from __future__ import annotations

import importlib
import os

import pytest

from support import matrix

SCOPE = os.environ.get("SHARDKIT_MATRIX", "pairwise")
WORLD = 2


def _entry_points() -> list[str]:
    available = []
    for entry in matrix.ENTRY_POINTS:
        try:
            importlib.import_module(f"support.matrix_{entry}")
        except ModuleNotFoundError as error:
            if error.name != f"support.matrix_{entry}":
                raise
            continue
        available.append(entry)
    return available


def test_pairwise_cover_is_complete():
    """The generator's cells cover every pair of every two dimensions of every entry point (the claim the
    pairwise run rests on), are far fewer than the whole matrix, and hold each costly value no more often than its
    pairs need."""
    for entry in _entry_points():
        dimensions = importlib.import_module(f"support.matrix_{entry}").DIMENSIONS
        cells = matrix.cells_for(entry, "pairwise")
        trained = [c for c in cells if matrix.expected_error(entry, c) is None]
        refused = [c for c in cells if matrix.expected_error(entry, c) is not None]
        possible = {pair for c in matrix.whole(dimensions) if matrix.expected_error(entry, c) is None
                    for pair in matrix.covered_pairs([c])}
        assert matrix.covered_pairs(trained) == possible, entry
        assert len(refused) == len([r for r in matrix.UNSUPPORTED if r[0] in ("*", entry)]), entry
        assert len(cells) < len(matrix.whole(dimensions)) / 4, (entry, len(cells))
        # A costly value (a compile cell) is in no more cells than its pairs need: as many as the other dimension
        # with the most values it may meet.
        for name, values in matrix.COSTLY.items():
            for value in values:
                meets = {(other, v) for pair in possible for (n, w), (other, v) in (pair, pair[::-1])
                         if (n, w) == (name, value)}
                needed = max(sum(1 for other, _ in meets if other == d) for d in dimensions if d != name)
                assert sum(1 for c in trained if c[name] == value) == needed, (entry, name, value, needed)


def _launch_timeout(entry: str) -> float:
    """Seconds for one entry point's launch: generous per cell (4 ranks' worth of load on 2 cores in CI)."""
    return 120 + 30 * len(matrix.cells_for(entry, SCOPE))


@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.timeout(_launch_timeout(e) + 60))
                                   for e in _entry_points()])
def test_matrix(ranks, entry):
    cells = matrix.cells_for(entry, SCOPE)
    outcomes = ranks.run(matrix.run_launch, WORLD, entry, cells, str(ranks.workdir), backend=None,
                         timeout=_launch_timeout(entry))
    problems = matrix.compare(entry, outcomes)
    assert not problems, f"{len(problems)} problem(s) in {len(cells)} cells:\n" + "\n".join(problems)

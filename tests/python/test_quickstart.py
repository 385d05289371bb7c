"""The README's Quickstart is examples/quickstart.py, and running it prints what the README says it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import harness

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "quickstart.py"


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block in the README's Quickstart section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("\n## Quickstart\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.M | re.S)


def test_readme_shows_the_example_and_how_to_run_it():
    (code_lang, code), (cmd_lang, cmd), (out_lang, _) = quickstart_blocks()
    assert (code_lang, cmd_lang, out_lang) == ("python", "bash", "")
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    header, body = lines[:2], "".join(lines[2:])  # two comment lines, then the README's code
    assert code == body
    assert cmd == "torchrun --standalone --nproc_per_node=4 examples/quickstart.py   # the code above\n"
    assert header[1] == "#   torchrun --standalone --nproc_per_node=4 examples/quickstart.py\n"


@pytest.mark.timeout(180)
def test_the_example_prints_what_the_readme_shows():
    result = harness.run_torchrun(EXAMPLE, 4, timeout=150)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    *_, (_, shown) = quickstart_blocks()
    got, expected = result.stdout.splitlines(), shown.splitlines()
    assert len(got) == len(expected) == 6, result.stdout
    assert got[-1] == expected[-1] == "4 ranks: all_reduce AVG = 1.5; 5 DDP steps done"
    pattern = re.compile(r"^step (\d): loss (\d+\.\d{4}) \(rank 0\)$")
    for step, (line, readme_line) in enumerate(zip(got[:-1], expected[:-1])):
        ours, theirs = pattern.match(line), pattern.match(readme_line)
        assert ours and theirs and ours[1] == theirs[1] == str(step), (line, readme_line)
        # Same seeds, same fixed reduction order; a CPU with other matmul kernels may round the last digit.
        assert float(ours[2]) == pytest.approx(float(theirs[2]), abs=2e-4), (line, readme_line)

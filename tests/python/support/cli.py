"""``python -m shardkit <command>`` run through its entry point in the calling process.

A fresh interpreter imports torch again (~4 s on a 2-core machine) for the same code path; where only the command's
exit code and output are asserted, this gives them without the process. Tests whose point is the interpreter itself
(its exit status after ``sys.exit(main())``, what reaches the real fd 2, no process group) still start one.
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def shardkit_here(*argv: str) -> subprocess.CompletedProcess:
    """main(argv) with stdout and stderr redirected: its return value (what ``python -m shardkit`` exits with),
    stdout and stderr, read like subprocess.run's result."""
    from shardkit.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return subprocess.CompletedProcess(["shardkit", *argv], code, out.getvalue(), err.getvalue())

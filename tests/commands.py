"""Independent command lines run two at a time.

Each test command here is a few seconds of Python start-up and a tiny job on one core;
CI has two, so running independent ones side by side halves their wall time without
changing what any of them does.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
from collections.abc import Sequence
from typing import Any

JOBS = 2


def run_all(argvs: Sequence[Sequence[str]], *, cwds: Sequence[Any] | None = None, jobs: int = JOBS,
            **kwargs: Any) -> list[subprocess.CompletedProcess]:
    """``subprocess.run(argv, capture_output=True, text=True, **kwargs)`` for each argv
    (in its own working directory when ``cwds`` is given), ``jobs`` at a time; the
    results in the order given."""
    cwds = list(cwds) if cwds is not None else [kwargs.pop("cwd", None)] * len(argvs)
    assert len(cwds) == len(argvs)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(subprocess.run, list(a), capture_output=True, text=True, cwd=c, **kwargs)
                   for a, c in zip(argvs, cwds)]
        return [f.result() for f in futures]

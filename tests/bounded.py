"""Running the `fuselane` command as a user would, under a bound on time and memory.

Hostile-input tests call `run_bounded` and then `assert_one_line_error`: the command must end in one
`fuselane: error:` line and exit code 1, within `FAST` seconds, in an address space of `MEMORY_LIMIT`, so a
runaway loop or allocation fails the test instead of stalling or swapping the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

TIMEOUT = 60  # a subprocess past this is a hang: the test fails rather than waiting on it
FAST = 10.0  # seconds a refusal may take, interpreter start-up included
MEMORY_LIMIT = 3 << 29  # 1.5 GiB of address space: the bar for any bad input
# one BLAS thread, so that the limit measures what fuselane allocates, not per-thread BLAS buffers
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _limit_memory(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_bounded(
    argv: Sequence[str | bytes],
    stdin: bytes | None = None,
    memory: int | None = MEMORY_LIMIT,
    timeout: float = TIMEOUT,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `python -m fuselane *argv` under `memory` bytes of address space; returns the result and seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fuselane", *argv],
        capture_output=True,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        timeout=timeout,
        preexec_fn=(lambda: _limit_memory(memory)) if memory else None,
        env=os.environ | ONE_THREAD | (env or {}),
    )
    return done, time.perf_counter() - started


def assert_one_line_error(done: subprocess.CompletedProcess, seconds: float, fast: float = FAST) -> str:
    """The CLI's contract for bad input (one `fuselane: error:` line, exit 1, quickly); returns the message."""
    err = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuselane: error: "), err
    assert done.returncode == 1, (done.returncode, err)
    assert seconds < fast, f"took {seconds:.1f} s"
    return lines[0]

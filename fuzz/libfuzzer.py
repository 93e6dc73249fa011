"""libFuzzer's run of a target, shared by the fuzz targets: atheris owns the process until it exits."""

from __future__ import annotations

import atexit
import signal
from collections.abc import Callable, Sequence

import atheris


def fuzz(argv: Sequence[str], test_one_input: Callable[[bytes], None]) -> None:
    """Run libFuzzer over `test_one_input` with its command line `argv`; it exits the process when done.

    libFuzzer's `-timeout` arms a repeating SIGALRM timer that outlives the run: once atheris has let go of the
    signal, a tick landing while the interpreter frees a large heap at exit kills a finished run with SIGALRM.
    The timer is disarmed first thing at exit.
    """
    atheris.Setup(list(argv), test_one_input)
    atexit.register(signal.setitimer, signal.ITIMER_REAL, 0)
    atheris.Fuzz()

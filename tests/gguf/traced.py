"""Peak memory of a call under tracemalloc, with tracing turned on once for a test module.

Why once: `tracemalloc.start()` and `stop()` swap CPython's raw allocator while other threads may be allocating
without the GIL (BLAS or torch workers, a server's threads left by an earlier test in the same worker). Before
CPython 3.12.9 / 3.13.2 that race can crash the process (python/cpython#128679: a segfault in a native
thread, seen here once in a few full runs at a test that started and stopped tracing 300 times). A module that
traces keeps it on from its first test to its last (`tracing`, a module-scoped fixture) and each call measures
its growth over what was live before it.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def tracing() -> Iterator[None]:
    """tracemalloc on for the module's tests, off after its last (once each way, whatever the test count)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    yield
    if started:
        tracemalloc.stop()


def peak_of(fn: Callable[[], Any]) -> tuple[Any, int]:
    """`fn()` and the most bytes it held at once beyond what was live when it began (tracing must be on)."""
    if not tracemalloc.is_tracing():
        raise RuntimeError("peak_of needs the `tracing` fixture")
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    result = fn()
    _, peak = tracemalloc.get_traced_memory()
    return result, max(0, peak - before)

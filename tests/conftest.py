"""Shared fixtures: the real checkpoint (pulled once into the user cache) and tiny synthetic ones."""

from __future__ import annotations

import importlib.util
import os

import pytest

# `pytest -m cuda tests` (the GPU run) spreads over this many pytest-xdist workers where xdist is installed and no
# `-n` was given: its time is host work (Triton compiling each kernel once, the f64 references), which one
# process does serially while the GPU waits. On a fresh 16-core H200 host (Triton's cache empty) four workers took
# 385 s whole; eight ran 185 of the 207 tests in 262 s, the rest being the longest groups (a shape's 4,096-token
# references, the hybrid's lane tests), which each run serially on one worker (RESULTS.md). Eight keep the memory
# within bounds (two groups hold an 8B-width f64 reference, 10 GB each). Tests sharing a costly module fixture (a
# reference model) carry an `xdist_group` mark so one worker builds it once (`--dist loadgroup`).
CUDA_WORKERS = 8
# Each worker's BLAS and OpenMP pools take the host's cores over the workers: one pool of every core a worker
# ran the host out of threads.
THREAD_POOLS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _without_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# Triton reads TRITON_INTERPRET as a kernel is decorated, and decorates its own library's functions as it is first
# imported: on a host without a GPU every kernel runs under the interpreter, so it is set before any test module
# imports Triton (one importing transformers does, through torch), whatever order the tests run in.
if _without_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from fuselane.lanes.cuda.triton import interpreter_calls

    interpreter_calls.install()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The GPU run's workers (`CUDA_WORKERS`); runs before pytest-xdist reads its options, and sets the workers'
    thread pools in the environment they start with."""
    wants_gpu = (config.option.markexpr or "").strip() == "cuda"
    chose = getattr(config.option, "numprocesses", None) is not None
    in_worker = "PYTEST_XDIST_WORKER" in os.environ  # a worker's options lack -n: it must not spread again
    if not wants_gpu or chose or in_worker or importlib.util.find_spec("xdist") is None:
        return
    config.option.numprocesses = CUDA_WORKERS
    config.option.dist = "loadgroup"
    per_worker = str(max(1, (os.cpu_count() or CUDA_WORKERS) // CUDA_WORKERS))
    for pool in THREAD_POOLS:
        os.environ.setdefault(pool, per_worker)


def pytest_configure(config: pytest.Config) -> None:
    # the mark pytest-xdist reads, declared here too so a host without xdist accepts it
    config.addinivalue_line("markers", "xdist_group(name): tests one pytest-xdist worker runs together")


@pytest.fixture(scope="session")
def qwen_gguf() -> str:
    """Path of the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, pulled and verified on first use.

    Set FUSELANE_SKIP_REAL=1 to skip the tests that need it (they run in CI).
    """
    if os.environ.get("FUSELANE_SKIP_REAL"):
        pytest.skip("FUSELANE_SKIP_REAL is set")
    from fuselane.hub import pull

    return str(pull("qwen2.5-coder-0.5b", quiet=True))

"""Shared fixtures: the real checkpoint (pulled once into the user cache) and tiny synthetic ones."""

from __future__ import annotations

import importlib.util
import os

import pytest

# `pytest -m cuda tests` (the GPU run) spreads over this many workers where pytest-xdist is installed and no `-n`
# was given: its time is CPU work (Triton compiling each kernel once, the f64 host references), which one
# process does serially while the GPU waits. Four keep a 16-core GPU host's compiles in parallel and its host
# memory (an 8B-width f64 reference holds 8 GB) well within bounds.
CUDA_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The GPU run's workers (`CUDA_WORKERS`); runs before pytest-xdist reads its options."""
    wants_gpu = (config.option.markexpr or "").strip() == "cuda"
    chose = getattr(config.option, "numprocesses", None) is not None
    if wants_gpu and not chose and importlib.util.find_spec("xdist") is not None:
        config.option.numprocesses = CUDA_WORKERS


@pytest.fixture(scope="session")
def qwen_gguf() -> str:
    """Path of the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, pulled and verified on first use.

    Set FUSELANE_SKIP_REAL=1 to skip the tests that need it (they run in CI).
    """
    if os.environ.get("FUSELANE_SKIP_REAL"):
        pytest.skip("FUSELANE_SKIP_REAL is set")
    from fuselane.hub import pull

    return str(pull("qwen2.5-coder-0.5b", quiet=True))

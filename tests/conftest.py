"""Shared fixtures: the real checkpoint (pulled once into the user cache) and tiny synthetic ones."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def qwen_gguf() -> str:
    """Path of the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, pulled and verified on first use.

    Set FUSELANE_SKIP_REAL=1 to skip the tests that need it (they run in CI).
    """
    if os.environ.get("FUSELANE_SKIP_REAL"):
        pytest.skip("FUSELANE_SKIP_REAL is set")
    from fuselane.hub import pull

    return str(pull("qwen2.5-coder-0.5b", quiet=True))

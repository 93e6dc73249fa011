"""A long prompt fed in the cuda lane's own chunks against the cpu lane in f64: the shared body of the GPU tests
that run a mixture's prompt past one `kernels.MOE_CHUNK_ROWS` chunk."""

from __future__ import annotations

import numpy as np

from fuselane.runtime.model import load


def feed_both(path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, float, int]:
    """The cuda lane's logits of `tokens` (a session in the lane's chunks), the cpu lane's in f64, the contract's
    tolerance, and the rows of the cuda session's chunk."""
    ref = load(path, lane="cpu", ctx=len(tokens) + 1, dtype=np.float64)
    want = ref.session().feed(tokens)
    ref.close()
    gpu = load(path, lane="cuda", ctx=len(tokens) + 1)
    session = gpu.session()
    got = np.asarray(session.feed(tokens))
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    gpu.close()
    return got, want, tol, session.chunk

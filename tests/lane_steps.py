"""A prompt's chunk, a short chunk and decode steps on the cuda lane against the cpu lane in f64: the shared body of
the tests that run a model's low-bit paths (interpreted in CI, compiled on a GPU)."""

from __future__ import annotations

import numpy as np

from fuselane.runtime.model import load


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def runs_as_the_cpu_lane(path, prompt: list[int], short: list[int], decode: list[int], *, ctx: int,
                         knobs: list[str] | None = None) -> None:  # fmt: skip
    """`prompt`, then `short`, then each token of `decode` on both lanes: every step finite on the cuda lane and
    within the lane's contract of the cpu lane's in f64."""
    gpu = load(path, lane="cuda", ctx=ctx, knobs=knobs or [])
    ref = load(path, lane="cpu", ctx=ctx, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session(), ref.session()
    steps = [(a.feed(prompt), b.feed(prompt)), (a.extend(short), b.extend(short))]
    steps += [(a.extend([t]), b.extend([t])) for t in decode]
    for step, (x, y) in enumerate(steps):
        assert np.isfinite(x).all(), f"step {step}: not finite"
        assert rel(x, y) <= tol, f"step {step}: {rel(x, y):.2e} > {tol:.2e}"
    gpu.close()
    ref.close()

"""The sum of two tensors (`misc.add`: a mixture's output and its ungated shared expert's, as a dependent launch)
under the interpreter on a CPU: one f32 rounding a value, so equal to numpy's f32 sum bit for bit, over a
width that leaves the last block ragged; tensors it cannot take are refused, not misread.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev  # noqa: E402

from fuselane.lanes.cuda.triton import misc  # noqa: E402


def test_add_is_the_f32_sum():
    rng = np.random.default_rng(31)
    a, b = (rng.standard_normal((1, misc.GLU_BLOCK + 37)).astype(np.float32) for _ in range(2))
    out = torch.full(a.shape, float("nan"), device=DEVICE)
    misc.add(dev(a), dev(b), out)
    assert np.array_equal(out.cpu().numpy(), a + b)


def test_add_refuses_a_strided_or_short_operand():
    x = torch.zeros((4, 8), device=DEVICE)
    with pytest.raises(ValueError, match="contiguous f32"):
        misc.add(x[:, :4], x[:, 4:], torch.zeros((4, 4), device=DEVICE))
    with pytest.raises(ValueError, match="contiguous f32"):
        misc.add(x, x[:2], x)

"""The batch step's device advance (`triton/advance.py`), interpreted, against the host's arithmetic: the next
step's ids are the picks, positions and lengths one on, slots those of the new positions in each row's table,
and the padding rows untouched."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE  # noqa: E402

from fuselane.lanes.cuda.plan.kernels import BATCH_COLUMNS, BATCH_ID, BATCH_LENGTH, BATCH_POSITION, BATCH_SLOT  # noqa: E402
from fuselane.lanes.cuda.run.paged import layout  # noqa: E402
from fuselane.lanes.cuda.triton.advance import advance  # noqa: E402
from fuselane.lanes.cuda.triton.sample import PICKED_VALUES, TOKEN  # noqa: E402


def reference(values: np.ndarray, picked: np.ndarray, n: int, rows: int, width: int, block_size: int) -> np.ndarray:
    out = values.copy()
    cols = out[: rows * BATCH_COLUMNS].reshape(BATCH_COLUMNS, rows)
    tables = out[rows * BATCH_COLUMNS :].reshape(rows, width)
    for r in range(n):
        pos = int(cols[BATCH_POSITION, r]) + 1
        cols[BATCH_ID, r], cols[BATCH_POSITION, r], cols[BATCH_LENGTH, r] = picked[r, TOKEN], pos, pos + 1
        cols[BATCH_SLOT, r] = tables[r, pos // block_size] * block_size + pos % block_size
    return out


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_the_advance_is_the_hosts(rows):
    width, bs, spare = 3, 4, 9
    n = max(1, rows - 2)  # some padding rows past the sequences' where the bucket has them
    rng = np.random.default_rng(rows)
    # positions at a block's last row (the next is in the following block), mid-block, and 0
    positions = [int(p) for p in rng.choice([3, 5, 0, 7, 2], n)]
    tables = [[int(b) for b in rng.permutation(spare)[:width]] for _ in range(n)]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    ids = [int(i) for i in rng.integers(1, 100, n)]
    values = layout(rows, width, ids, positions, slots, tables, spare, bs)
    picked = np.zeros((rows, PICKED_VALUES), dtype=np.int32)
    picked[:, TOKEN] = rng.integers(0, 1000, rows)
    inputs = torch.from_numpy(values.copy()).to(DEVICE)
    advance(inputs, torch.from_numpy(picked).to(DEVICE), n, rows, width, bs)
    assert inputs.cpu().numpy().tolist() == reference(values, picked, n, rows, width, bs).tolist()
    # twice over: the second step's rows start where the first left them
    twice = reference(reference(values, picked, n, rows, width, bs), picked, n, rows, width, bs)
    advance(inputs, torch.from_numpy(picked).to(DEVICE), n, rows, width, bs)
    assert inputs.cpu().numpy().tolist() == twice.tolist()


def test_the_advance_refuses_inputs_of_another_shape():
    inputs = torch.zeros(2 * (BATCH_COLUMNS + 3), dtype=torch.int32, device=DEVICE)
    picked = torch.zeros((2, PICKED_VALUES), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        advance(inputs, picked, 1, 2, 4, 4)
    with pytest.raises(ValueError):
        advance(inputs, picked, 3, 2, 3, 4)

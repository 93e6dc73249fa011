"""A batch's draws in one launch (`sample.sample_rows`) against the one-row device sampler (`sample_token`, whose
distribution `test_sample.py` holds to the host Sampler's): each sampling row, under its own sequence's
temperature, top-p, top-k and seed, draws the tokens `sample_token` draws from that row's `candidates` with the
same generator, step after step; a greedy or padding row (slot -1) keeps its arg-max pick; a NaN is flagged.

Rows of distinct logits (no ties, whose order a top-k may leave otherwise), a vocabulary of 300: the rows' tile
is then the one `sample_token` takes for a whole row, and a top-k's narrower tile sums the same weights.
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

from fuselane.lanes.cuda.triton import sample as S  # noqa: E402

VOCAB = 300
# each slot's (temperature, top-p, top-k, seed): top-k and top-p, the whole row, a sharp top-k
SETTINGS = [(0.8, 0.9, 40, 3), (1.0, 1.0, 0, 11), (0.5, 0.95, 7, 12345)]
SLOTS = [1, -1, 0, 2]  # row 1 is greedy: it keeps its arg-max
STEPS = 4
NO_PICK = -7  # what a row that does not sample holds before the launch


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    params = [(t, p, k if 0 < k < VOCAB else VOCAB) for t, p, k, _ in SETTINGS]
    return (
        torch.tensor(params, dtype=torch.float32, device=DEVICE),
        torch.tensor([(seed, 0) for *_, seed in SETTINGS], dtype=torch.int64, device=DEVICE),
    )


def _alone(row: np.ndarray, slot: int, steps: int) -> list[int]:
    """The one-row sampler's tokens for `row` under slot `slot`'s settings, one draw a step."""
    t, p, k, seed = SETTINGS[slot]
    k = k if 0 < k < VOCAB else VOCAB
    vals = torch.empty(k, dtype=torch.float32, device=DEVICE)
    idx = torch.empty(k, dtype=torch.int64, device=DEVICE)
    S.candidates(dev(row), vals, idx)
    params = torch.tensor([t, p], dtype=torch.float32, device=DEVICE)
    rng = torch.tensor([seed, 0], dtype=torch.int64, device=DEVICE)
    picked = S.new_picked(DEVICE)
    tokens = []
    for _ in range(steps):
        S.sample_token(vals, idx, params, rng, picked)
        tokens.append(picked[S.TOKEN].item())
    return tokens


def _buffers(logits: np.ndarray):
    rows = logits.shape[0]
    vals = torch.empty((rows, VOCAB), dtype=torch.float32, device=DEVICE)
    idx = torch.empty((rows, VOCAB), dtype=torch.int64, device=DEVICE)
    slots = torch.tensor(SLOTS[:rows], dtype=torch.int32, device=DEVICE)
    return dev(logits), vals, idx, slots


def test_each_row_draws_as_the_one_row_sampler_with_its_own_settings_and_seed():
    rng_np = np.random.default_rng(4)
    logits = np.stack([rng_np.permutation(np.linspace(-3.0, 3.0, VOCAB)) for _ in SLOTS]).astype(np.float32)
    x, vals, idx, slots = _buffers(logits)
    params, rng = _tables()
    picked = torch.full((len(SLOTS), S.PICKED_VALUES), NO_PICK, dtype=S.PICKED_DTYPE, device=DEVICE)
    got: list[list[int]] = [[] for _ in SLOTS]
    for _ in range(STEPS):
        S.sample_rows(x, vals, idx, slots, params, rng, picked)
        for r, (token, nan) in enumerate(picked.tolist()):
            got[r].append(token)
            assert nan == (0 if SLOTS[r] >= 0 else NO_PICK)
    for r, slot in enumerate(SLOTS):
        assert got[r] == ([NO_PICK] * STEPS if slot < 0 else _alone(logits[r], slot, STEPS)), f"row {r}"
    assert rng[:, S.COUNTER].tolist() == [STEPS] * len(SETTINGS)  # each sequence's generator advanced a draw a step


def test_a_nan_row_is_flagged():
    logits = np.random.default_rng(5).standard_normal((1, VOCAB)).astype(np.float32)
    logits[0, 17] = np.nan
    x, vals, idx, slots = _buffers(logits)
    params, rng = _tables()
    picked = torch.zeros((1, S.PICKED_VALUES), dtype=S.PICKED_DTYPE, device=DEVICE)
    with np.errstate(invalid="ignore"):
        S.sample_rows(x, vals, idx, slots, params, rng, picked)
    token, nan = picked[0].tolist()
    assert nan == 1 and 0 <= token < VOCAB


def test_bad_buffers_are_refused():
    x, vals, idx, slots = _buffers(np.zeros((2, VOCAB), np.float32))
    params, rng = _tables()
    with pytest.raises(ValueError, match="picks"):
        S.sample_rows(x, vals, idx, slots, params, rng, torch.zeros((3, 2), dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="slots"):
        S.sample_rows(x, vals, idx, slots.long(), params, rng, torch.zeros((2, 2), dtype=torch.int32, device=DEVICE))

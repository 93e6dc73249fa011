"""The device sampler's kernels (`fuselane.lanes.cuda.triton.sample`) against NumPy and the host Sampler.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one, on the device.

The arg-max must equal numpy.argmax exactly (ties to the lowest index), on rows as wide as a vocabulary and
not a whole number of the kernel's chunks, and flag any NaN. Sampling must draw from the host Sampler's
distribution: `exact` below computes it in f64 the way `fuselane.runtime.sampling.Sampler` does (top-k, then
the temperature on the gaps below the best logit, then the smallest prefix whose mass reaches top-p), and
thousands of draws are held to it by Pearson's chi-square test: the statistic's upper tail probability under
that distribution (chi-square with one degree of freedom fewer than the tokens drawn from; `chi2_sf` computes
it exactly from the regularized incomplete gamma function) must be above ALPHA. Every expected count is kept
at 80 or more, where the chi-square law is an accurate approximation of the multinomial one. A token of
probability zero (cut by top-k or top-p) must never be drawn at all. The draws are seeded, so each test is
deterministic; ALPHA says how unlikely the draws it accepts may be, and the power checks show the same draws
rejected against a distribution a little off (the cut or the temperature left out).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev  # noqa: E402

from fuselane.lanes.cuda.triton import misc  # noqa: E402
from fuselane.lanes.cuda.triton import sample as S  # noqa: E402

ALPHA = 1e-6
DRAWS = 8192
MIN_EXPECTED = 80  # every expected count at least this: the chi-square approximation holds
QWEN_VOCAB = 151_936  # 37 chunks and a part
# the interpreter's NumPy reductions warn on the all-NaN values a NaN row's arithmetic leads to
NAN_WARNING = "ignore:All-NaN slice encountered:RuntimeWarning"
CF_ITERATIONS = 1000
CF_TINY = 1e-300
CF_EPS = 1e-15


# ---- the reference -----------------------------------------------------------------------------------------


def exact(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The host Sampler's probability of each token, in f64 (ties at the k-th logit are not used here)."""
    x = logits.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    if 0 < top_k < x.size:
        order = order[:top_k]
    chosen = x[order]
    probs = np.exp((chosen - chosen[0]) / temperature)
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    out = np.zeros(x.size)
    out[order] = probs
    return out


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with `df` degrees of freedom: the regularized upper incomplete gamma
    Q(df / 2, stat / 2), by its series below a + 1 and its continued fraction above (Numerical Recipes 6.2)."""
    a, z = df / 2, stat / 2
    if z <= 0:
        return 1.0
    front = math.exp(a * math.log(z) - z - math.lgamma(a))
    if z < a + 1:
        term = total = 1.0 / a
        n = 0
        while term > total * CF_EPS:
            n += 1
            term *= z / (a + n)
            total += term
        return max(0.0, 1.0 - front * total)
    b = z + 1 - a
    c, d = 1 / CF_TINY, 1 / b
    h = d
    for i in range(1, CF_ITERATIONS):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > CF_TINY else CF_TINY
        c = b + an / c
        c = c if abs(c) > CF_TINY else CF_TINY
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < CF_EPS:
            break
    return front * h


def test_chi2_sf_known_values():
    # chi-square with 2 degrees of freedom is exponential: P(X >= s) = e^(-s/2); with 1, erfc(sqrt(s/2))
    for s in (0.5, 3.0, 40.0):
        assert math.isclose(chi2_sf(s, 2), math.exp(-s / 2), rel_tol=1e-9)
        assert math.isclose(chi2_sf(s, 1), math.erfc(math.sqrt(s / 2)), rel_tol=1e-9)


def chi2_p(counts: np.ndarray, probs: np.ndarray, *, checked: bool = True) -> float:
    """Pearson's test of `counts` against `probs` over the tokens of positive probability (`checked`: each
    expected count large enough for the chi-square law; a power check's wrong distribution need not be)."""
    live = probs > 0
    expected = counts.sum() * probs[live]
    assert not checked or expected.min() >= MIN_EXPECTED, "a case whose expected counts are too small"
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(live.sum()) - 1)


# ---- helpers -----------------------------------------------------------------------------------------------


def params_of(temperature: float, top_p: float) -> torch.Tensor:
    return torch.tensor([temperature, top_p], dtype=torch.float32, device=DEVICE)


def rng_of(seed: int, counter: int = 0) -> torch.Tensor:
    return torch.tensor([seed, counter], dtype=torch.int64, device=DEVICE)


def candidates_of(x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = top_k if 0 < top_k < x.numel() else x.numel()
    vals = torch.empty(k, dtype=torch.float32, device=DEVICE)
    idx = torch.empty(k, dtype=torch.int64, device=DEVICE)
    S.candidates(x, vals, idx)
    return vals, idx


def draw(logits: np.ndarray, temperature: float, top_k: int, top_p: float, n: int = DRAWS, seed: int = 5):
    """`n` tokens drawn by the kernel, MAX_DRAWS a launch, and how many of each."""
    vals, idx = candidates_of(dev(logits), top_k)
    params, rng = params_of(temperature, top_p), rng_of(seed)
    picked = S.new_picked(DEVICE, S.MAX_DRAWS)
    tokens = []
    for _ in range(n // S.MAX_DRAWS):
        S.sample_token(vals, idx, params, rng, picked, draws=S.MAX_DRAWS)
        assert picked[S.MAX_DRAWS].item() == 0, "a NaN flag without a NaN"
        tokens.append(picked[: S.MAX_DRAWS].cpu().numpy().copy())
    assert rng[S.COUNTER].item() == n, "the counter advances by one a draw"
    drawn = np.concatenate(tokens)
    return drawn, np.bincount(drawn, minlength=logits.size)


def argmax_of(x: np.ndarray, **feed) -> tuple[int, int]:
    picked = S.new_picked(DEVICE)
    scratch = S.argmax_scratch(x.size, DEVICE)
    S.argmax_token(dev(x), picked, scratch, **feed)
    assert not scratch[-1:].view(torch.int32).item(), "the merge left its counter armed"
    token, nan = picked.tolist()
    return token, nan


# ---- arg-max -----------------------------------------------------------------------------------------------


CHUNK = misc.ARGMAX_CHUNK


def test_argmax_rows_picks_each_rows_token_in_one_launch_and_rearms():
    """A batch's greedy picks: rows of ragged maxima, a tie (the lowest index), a NaN row (flagged, token 0),
    each row's own counter back at zero after the launch, twice over the same scratch."""
    cols, rows = 3 * CHUNK - 5, 4
    rng = np.random.default_rng(7)
    scratch = torch.zeros((rows, S.argmax_scratch_size(cols)), dtype=torch.float32, device=DEVICE)
    picked = torch.zeros((rows, S.PICKED_VALUES), dtype=S.PICKED_DTYPE, device=DEVICE)
    for _ in range(2):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        x[1, [5, 2 * CHUNK + 1]] = 50.0  # a tie across chunks
        x[2, CHUNK + 3] = np.nan
        S.argmax_rows(dev(x), picked, scratch)
        want = [[int(np.argmax(x[0])), 0], [5, 0], [0, 1], [int(np.argmax(x[3])), 0]]
        assert picked.tolist() == want
        counters = scratch[:, 3 * S.argmax_splits(cols)].contiguous().view(torch.int32)
        assert not counters.any(), "a row's merge left its counter armed"


@pytest.mark.parametrize("cols", [1, 7, CHUNK, CHUNK + 1, 3 * CHUNK - 5, QWEN_VOCAB])
def test_argmax_equals_numpy(cols):
    rng = np.random.default_rng(cols)
    for scale in (1.0, 30.0):
        x = (rng.standard_normal(cols) * scale).astype(np.float32)
        assert argmax_of(x) == (int(np.argmax(x)), 0)


def test_argmax_ties_and_infinities():
    chunk = CHUNK
    cols = 2 * chunk + 123  # three chunks, the last one partial
    rng = np.random.default_rng(2)
    base = rng.standard_normal(cols).astype(np.float32)
    cases = {
        "tie in a chunk": ([7, 4000], 9.0),
        "tie across chunks": ([chunk + 100, 2 * chunk + 50], 9.0),
        "either side of a boundary": ([chunk - 1, chunk], 9.0),
        "in the partial chunk": ([cols - 1], 9.0),
        "+inf twice": ([chunk + 5, 3], np.inf),
    }
    for what, (at, value) in cases.items():
        x = base.copy()
        x[at] = value
        assert argmax_of(x) == (int(np.argmax(x)), 0), what
    for fill in (-np.inf, 0.0):  # all equal: index 0
        assert argmax_of(np.full(cols, fill, dtype=np.float32)) == (0, 0)
    x = np.full(cols, -np.inf, dtype=np.float32)
    x[2 * chunk + 7] = -1e30  # the one finite value, among -inf
    assert argmax_of(x) == (2 * chunk + 7, 0)


@pytest.mark.filterwarnings(NAN_WARNING)
@pytest.mark.parametrize("at", [0, 5000, QWEN_VOCAB - 1])
def test_argmax_flags_a_nan(at):
    x = np.random.default_rng(at).standard_normal(QWEN_VOCAB).astype(np.float32)
    x[at] = np.nan
    token, nan = argmax_of(x)
    assert nan == 1
    assert 0 <= token < QWEN_VOCAB, "the token written on a NaN must still be a row of the embedding"
    assert argmax_of(np.full(10, np.nan, dtype=np.float32)) == (0, 1)


def test_argmax_feeds_the_next_step():
    x = np.random.default_rng(3).standard_normal(QWEN_VOCAB).astype(np.float32)
    ids = torch.tensor([-1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    token, _ = argmax_of(x, ids=ids, pos=pos)
    assert token == int(np.argmax(x))
    assert ids.item() == token and pos.item() == 42
    argmax_of(x, ids=ids, pos=pos)
    assert pos.item() == 43, "each launch advances the position once"


# ---- sampling ----------------------------------------------------------------------------------------------

VOCAB = 12
CASES = {  # (temperature, top_k, top_p): each filter alone, and the three in the host's order
    "softmax": (1.0, 0, 1.0),
    "top-k": (0.7, 5, 1.0),
    "top-p": (1.3, 0, 0.8),
    "all three": (0.8, 8, 0.9),
    "top-k past the vocabulary": (1.0, VOCAB + 3, 0.95),
}


def logits_of(seed: int) -> np.ndarray:
    # spread so that every kept token has an expected count of at least MIN_EXPECTED in DRAWS
    return np.sort(np.random.default_rng(seed).uniform(-1.0, 1.0, VOCAB)).astype(np.float32)[::-1].copy()


@pytest.mark.parametrize("case", CASES)
def test_sampling_matches_the_host_distribution(case):
    temperature, top_k, top_p = CASES[case]
    x = np.random.default_rng(11).permutation(logits_of(7))  # the best tokens anywhere in the row
    probs = exact(x, temperature, top_k, top_p)
    drawn, counts = draw(x, temperature, top_k, top_p)
    assert not counts[probs == 0].any(), "drew a token that top-k or top-p cut"
    assert chi2_p(counts, probs) > ALPHA


def test_the_chi_square_test_has_power():
    # the same draws, held to distributions a little off, fail: the test can tell them apart
    x = logits_of(7)
    temperature, top_k, top_p = CASES["all three"]
    _, counts = draw(x, temperature, top_k, top_p)
    assert chi2_p(counts, exact(x, temperature, top_k, top_p)) > ALPHA
    assert chi2_p(counts, exact(x, 1.0, top_k, top_p)) < ALPHA, "the temperature left out"
    assert chi2_p(counts, exact(x, temperature, top_k, 1.0), checked=False) < ALPHA, "the top-p cut left out"
    assert chi2_p(counts, exact(x, temperature, 0, top_p), checked=False) < ALPHA, "top-k left out"


def test_sampling_over_many_tiles_and_ties():
    # 3 * SAMPLE_TILE equal logits: a stable sort keeps them in index order, so top-p keeps the lowest
    # indices, and the cut (5000 of 12288) falls in the second tile; binned by index, the draws are uniform
    cols = 3 * S.SAMPLE_TILE
    keep = 5000
    x = np.zeros(cols, dtype=np.float32)
    top_p = (keep - 0.5) / cols  # halfway between two prefixes' mass, clear of rounding
    probs = exact(x, 1.0, 0, top_p)
    assert np.count_nonzero(probs) == keep
    drawn, _ = draw(x, 1.0, 0, top_p, n=4 * S.MAX_DRAWS)
    assert drawn.max() < keep, "drew past the top-p cut"
    bins = 8
    counts = np.bincount(drawn * bins // keep, minlength=bins)
    assert chi2_p(counts, np.full(bins, 1 / bins)) > ALPHA


def test_top_k_one_is_the_argmax():
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal(QWEN_VOCAB).astype(np.float32)
        drawn, _ = draw(x, 1.0, 1, 1.0, n=S.MAX_DRAWS, seed=seed)
        assert set(drawn.tolist()) == {argmax_of(x)[0]}


def test_top_p_edge_cases():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    n = 2 * S.MAX_DRAWS
    assert set(draw(x, 1.0, 0, 0.7, n=n)[0].tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(draw(x, 1.0, 0, 0.4, n=n)[0].tolist()) == {0}  # the best alone reaches it
    assert set(draw(x, 1.0, 0, 1e-6, n=n)[0].tolist()) == {0}  # always at least one
    assert set(draw(x, 1.0, 0, 1.0, n=n)[0].tolist()) == {0, 1, 2, 3}  # off: even the 5% token
    # a very small temperature: only the best (its ties split evenly), never NaN
    y = np.array([1.0, 3.0, 3.0, -np.inf, 2.999], dtype=np.float32)
    drawn, counts = draw(y, 1e-6, 0, 1.0, n=n)
    assert set(drawn.tolist()) == {1, 2}
    assert chi2_p(counts, exact(y, 1e-6, 0, 1.0)) > ALPHA


def test_same_seed_same_tokens_other_seed_differs():
    x = logits_of(3)
    a, _ = draw(x, 1.0, 0, 1.0, n=S.MAX_DRAWS, seed=9)
    b, _ = draw(x, 1.0, 0, 1.0, n=S.MAX_DRAWS, seed=9)
    c, _ = draw(x, 1.0, 0, 1.0, n=S.MAX_DRAWS, seed=10)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_one_draw_at_a_time_is_the_same_stream():
    # the decode step draws one token a launch: at counters 0, 1, 2, ... as one launch of many draws
    x = logits_of(4)
    vals, idx = candidates_of(dev(x), 0)
    params, rng = params_of(1.0, 1.0), rng_of(21)
    ids = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    picked = S.new_picked(DEVICE)
    one = []
    for _ in range(16):
        S.sample_token(vals, idx, params, rng, picked, ids=ids, pos=pos)
        one.append(picked[S.TOKEN].item())
        assert ids.item() == one[-1]
    assert pos.item() == 16 and rng[S.COUNTER].item() == 16
    many, _ = draw(x, 1.0, 0, 1.0, n=S.MAX_DRAWS, seed=21)
    assert one == many[:16].tolist()


@pytest.mark.filterwarnings(NAN_WARNING)
def test_sampling_flags_a_nan():
    x = np.random.default_rng(5).standard_normal(QWEN_VOCAB).astype(np.float32)
    x[1234] = np.nan
    for top_k in (40, 0):
        vals, idx = candidates_of(dev(x), top_k)
        picked = S.new_picked(DEVICE)
        S.sample_token(vals, idx, params_of(0.8, 0.95), rng_of(1), picked)
        token, nan = picked.tolist()
        assert nan == 1 and 0 <= token < QWEN_VOCAB

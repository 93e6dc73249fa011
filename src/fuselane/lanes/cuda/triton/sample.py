"""The token sampler on the device: arg-max (greedy) and seeded sampling with temperature, top-k and top-p.

Each kernel writes the token it picks, and whether the logits held a NaN, to a 2-value int32 tensor (`picked`:
the host copies those eight bytes, never the logits). Given the decode step's input-id and position buffers
it also writes the token as the next step's input and advances the position, so a captured decode graph that
ends with the sampler feeds itself: the next replay needs no copy from the host.

Arg-max. A row as wide as a vocabulary (152k values for Qwen) is cut into chunks, a block a chunk (misc's
arg-max's chunking), so the read spreads over the chip; each block writes its chunk's best (value, index) and
whether the chunk holds a NaN to scratch, and the last block to finish (an atomic counter, re-armed by that
block, as flash_decode's merge) picks the row's best and ORs the flags. One launch. Ties go to the lowest
index, as numpy.argmax breaks them: the smallest index among the lanes holding a chunk's maximum, and the
earliest chunk among those holding the row's.

Sampling follows the host's `Sampler` (fuselane.runtime.sampling) step by step, on the device:
1. the candidates, best first: `torch.topk` for top-k, or a stable descending sort when top-k is off (ties in
   index order, as the host's stable argsort); both run on the device without a host sync and into buffers
   allocated once, so they are captured in a CUDA graph. torch orders NaN above every number, so the first
   candidate is NaN exactly when the row holds one;
2. one program over the candidates in tiles: weights w_i = exp((c_i - c_0) / T), the gaps below the best
   scaled by the temperature (as the host: a tiny T sends the gaps to -inf, weight 0, never NaN), and their
   total S;
3. top-p: the smallest prefix whose running weight reaches top_p * S (the host's first index where the
   cumulative probability reaches top_p), its weight M; skipped when top_p is 1;
4. a uniform u in [0, 1) from Philox keyed by the seed at a counter, both device values (the kernel advances
   the counter, so each replay of a graph draws a fresh number and the same seed gives the same tokens), and
   the first candidate whose running weight passes u * M: the inverse CDF, as numpy's `choice` draws.
Temperature, top-p, seed and counter are device values read by the kernel, so changing them needs no new
graph; only the number of candidates (top-k) is a shape. The arithmetic is f32 where the host's is f64: the
distribution is the host's up to f32 rounding of each probability (and u has 24 bits), and a cut through
exactly tied logits may keep different members of the tie than the host, whose top-k leaves ties unordered.
Scans after the cut stop at the tile where they hit, so only the total reads every candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.misc import ARGMAX_CHUNK, ARGMAX_WARPS, NO_INDEX, best_of

# `picked`: the token, then 1 where the logits held a NaN (0 otherwise); `draws` tokens then the flag when a
# launch draws many.
TOKEN = 0
NAN_FLAG = 1
PICKED_VALUES = 2
PICKED_DTYPE = torch.int32

# `params` (f32): the temperature, then top-p. `rng` (int64): the Philox seed, then the draw counter.
TEMPERATURE = 0
TOP_P = 1
PARAMS_VALUES = 2
SEED = 0
COUNTER = 1
RNG_VALUES = 2

# A sampling tile: at most 4096 candidates, sixteen a thread over eight warps (the arg-max's shape); a top-k
# of 40 takes one tile of 64.
SAMPLE_VALUES_A_THREAD = 16
SAMPLE_MAX_WARPS = 8
SAMPLE_TILE = SAMPLE_MAX_WARPS * kernels.WARP * SAMPLE_VALUES_A_THREAD
SAMPLE_MIN_TILE = 16  # tl.arange's smallest useful block
# Many draws in one launch compare each target with every running weight of a tile: at most this many
# comparisons a tile (64 a thread of eight warps), and at least SAMPLE_MIN_TILE weights a draw.
PICK_VALUES = 4 * SAMPLE_TILE
MAX_DRAWS = SAMPLE_TILE // SAMPLE_MIN_TILE
# A uniform from the top 24 bits of a 32-bit draw: exactly representable in f32 and below 1.
UNIFORM_BITS = 24
UNIFORM_SHIFT: tl.constexpr = tl.constexpr(32 - UNIFORM_BITS)
UNIFORM_SCALE: tl.constexpr = tl.constexpr(2.0**-UNIFORM_BITS)

# A batch's sequences' settings, a row of ROW_PARAMS f32 each (`sample_rows`): the temperature, top-p, then the
# candidates a draw picks from (top-k, or the vocabulary: exact in f32 below 2^24).
CANDIDATES = 2
ROW_PARAMS = 3

# The places above as the kernels read them: a jit function sees a module's globals only as constexprs.
_CANDIDATES: tl.constexpr = tl.constexpr(CANDIDATES)
ROW_PARAMS_C: tl.constexpr = tl.constexpr(ROW_PARAMS)
PICKED_VALUES_C: tl.constexpr = tl.constexpr(PICKED_VALUES)
RNG_VALUES_C: tl.constexpr = tl.constexpr(RNG_VALUES)
_TOKEN: tl.constexpr = tl.constexpr(TOKEN)
_NAN_FLAG: tl.constexpr = tl.constexpr(NAN_FLAG)
_TEMPERATURE: tl.constexpr = tl.constexpr(TEMPERATURE)
_TOP_P: tl.constexpr = tl.constexpr(TOP_P)
_SEED: tl.constexpr = tl.constexpr(SEED)
_COUNTER: tl.constexpr = tl.constexpr(COUNTER)


@triton.jit
def _feed(token, ids_ptr, pos_ptr):
    """Make the pick the next step's input, at the next position."""
    tl.store(ids_ptr, token.to(ids_ptr.dtype.element_ty))
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)


@triton.jit
def _emit(token, nan, out_ptr, ids_ptr, pos_ptr, FEED: tl.constexpr):
    """Write one pick and the NaN flag after it; with FEED, feed it to the next step."""
    tl.store(out_ptr + _TOKEN, token)
    tl.store(out_ptr + _NAN_FLAG, nan)
    if FEED:
        _feed(token, ids_ptr, pos_ptr)


@triton.jit
def _argmax_kernel(
    x_ptr,
    out_ptr,
    ids_ptr,
    pos_ptr,
    val_ptr,
    idx_ptr,
    nan_ptr,
    count_ptr,
    cols,
    x_pitch,
    out_pitch,
    scratch_pitch,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    FEED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)  # a batch's rows, each with its scratch and counter (`argmax_rows`)
    x_ptr += row * x_pitch
    out_ptr += row * out_pitch
    val_ptr += row * scratch_pitch
    idx_ptr += row * scratch_pitch
    nan_ptr += row * scratch_pitch
    count_ptr += row * scratch_pitch
    idx = split * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + idx, mask=idx < cols, other=float("-inf")).to(tl.float32)
    nan = tl.max((x != x).to(tl.int32), axis=0)
    best, best_i = best_of(x, idx)
    if SPLITS == 1:
        # a NaN's comparisons may leave no lane holding the maximum: the token stays an index of the row
        token = tl.where(nan != 0, 0, tl.minimum(best_i, cols - 1))
        _emit(token, nan, out_ptr, ids_ptr, pos_ptr, FEED)
    else:
        tl.store(val_ptr + split, best)
        tl.store(idx_ptr + split, best_i)
        tl.store(nan_ptr + split, nan)
        # stored before the release, as in flash_decode's merge: the block's barrier, then an acq_rel atomic
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            s = tl.arange(0, SPLITS_P2)
            smask = s < SPLITS
            vals = tl.load(val_ptr + s, mask=smask, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(idx_ptr + s, mask=smask, other=NO_INDEX, cache_modifier=".cg")
            nans = tl.load(nan_ptr + s, mask=smask, other=0, cache_modifier=".cg")
            any_nan = tl.max(nans, axis=0)
            # the chunks' indices grow with the chunk: the smallest index holding the best value is the first
            pick = tl.min(tl.where(vals == tl.max(vals, axis=0), idxs, NO_INDEX), axis=0)
            token = tl.where(any_nan != 0, 0, tl.minimum(pick, cols - 1))
            _emit(token, any_nan, out_ptr, ids_ptr, pos_ptr, FEED)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


@triton.jit
def _weights(vals_ptr, start, k, best, temperature, BLOCK: tl.constexpr):
    """A tile's candidate weights exp((c - best) / T), 0 past the last candidate; and its indices."""
    i = start + tl.arange(0, BLOCK)
    v = tl.load(vals_ptr + i, mask=i < k, other=float("-inf"))
    return tl.exp((v - best) / temperature), i


@triton.jit
def _first_reaching(vals_ptr, k, best, temperature, above, reach, BLOCK: tl.constexpr, N: tl.constexpr):
    """For each of the N values of `above`: the first candidate whose running weight passes it or reaches
    `reach`, and that running weight; where none does (a rounding apart from the total), the last candidate
    of positive weight and the total. The scan stops at the tile where the last of them is found."""
    offs = tl.arange(0, BLOCK)
    carry = tl.zeros([], tl.float32)
    found = tl.full([N], 0, tl.int32) + k
    mass = tl.zeros([N], tl.float32)
    last = 0
    start = 0
    while (tl.max(found, axis=0) == k) & (start < k):
        w, i = _weights(vals_ptr, start, k, best, temperature, BLOCK)
        c = carry + tl.cumsum(w, axis=0)
        hit = ((c[None, :] > above[:, None]) | (c[None, :] >= reach)) & (i < k)[None, :]
        first = tl.min(tl.where(hit, offs[None, :], BLOCK), axis=1)
        new = (found == k) & (first < BLOCK)
        found = tl.where(new, start + first, found)
        at = tl.sum(tl.where(offs[None, :] == first[:, None], c[None, :], 0.0), axis=1)
        mass = tl.where(new, at, mass)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, i, 0), axis=0))
        carry = tl.max(c, axis=0)  # the weights are >= 0: the running sum's last value is its largest
        start += BLOCK
    mass = tl.where(found == k, carry, mass)
    found = tl.where(found == k, last, found)
    return found, mass


@triton.jit
def _draw(vals_ptr, idx_ptr, params_ptr, rng_ptr, out_ptr, k, BLOCK: tl.constexpr, PICK_BLOCK: tl.constexpr,
          DRAWS: tl.constexpr):  # fmt: skip
    """DRAWS seeded draws from the first `k` candidates (best first) under `params` and `rng` (advanced), into
    out[:DRAWS] with the NaN flag after them; returns the draws' tokens."""
    best = tl.load(vals_ptr)
    nan = (best != best).to(tl.int32)  # candidates come best first, and torch orders NaN first
    temperature = tl.load(params_ptr + _TEMPERATURE)
    top_p = tl.load(params_ptr + _TOP_P)
    total = tl.zeros([], tl.float32)
    start = 0
    while start < k:  # not a range over k: Triton's interpreter passes k as a 1-value array
        w, _ = _weights(vals_ptr, start, k, best, temperature, BLOCK)
        total += tl.sum(w, axis=0)
        start += BLOCK
    kept = total
    limit = k - 1
    if top_p < 1.0:
        # the smallest prefix whose weight reaches top_p of the total (always at least the best)
        never = tl.full([1], float("inf"), tl.float32)
        cut, mass = _first_reaching(vals_ptr, k, best, temperature, never, top_p * total, BLOCK, 1)
        kept = tl.sum(mass, axis=0)
        limit = tl.max(cut, axis=0)
    seed = tl.load(rng_ptr + _SEED)
    counter = tl.load(rng_ptr + _COUNTER)
    draws = tl.randint(seed, counter + tl.arange(0, DRAWS)).to(tl.uint32, bitcast=True)
    u = (draws >> UNIFORM_SHIFT).to(tl.float32) * UNIFORM_SCALE
    tl.store(rng_ptr + _COUNTER, counter + DRAWS)
    # the first running weight past u * M; `reach` M catches a product u * M rounded up to M itself, and the
    # limit a running sum rounded below the cut's (a pick's tile may be narrower than the cut's)
    pick, _ = _first_reaching(vals_ptr, k, best, temperature, u * kept, kept, PICK_BLOCK, DRAWS)
    pick = tl.minimum(pick, limit)
    tokens = tl.where(nan != 0, 0, tl.load(idx_ptr + pick).to(tl.int32))
    tl.store(out_ptr + tl.arange(0, DRAWS), tokens)
    tl.store(out_ptr + DRAWS, nan)
    return tokens


@triton.jit
def _sample_kernel(
    vals_ptr,
    idx_ptr,
    params_ptr,
    rng_ptr,
    out_ptr,
    ids_ptr,
    pos_ptr,
    k,
    BLOCK: tl.constexpr,
    PICK_BLOCK: tl.constexpr,
    DRAWS: tl.constexpr,
    FEED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    tokens = _draw(vals_ptr, idx_ptr, params_ptr, rng_ptr, out_ptr, k, BLOCK, PICK_BLOCK, DRAWS)
    if FEED:
        _feed(tl.max(tokens, axis=0), ids_ptr, pos_ptr)  # one draw when fed: its token


@triton.jit
def _sample_rows_kernel(vals_ptr, idx_ptr, slots_ptr, params_ptr, rng_ptr, out_ptr, cols, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
    # A batch's rows, a program each: a row whose slot is a sequence's draws from its sorted row under that
    # sequence's settings and generator (`_draw`, its own top-k as its candidates); a row of slot -1 (greedy, or
    # padding) keeps the pick the arg-max wrote.
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        params = params_ptr + slot * ROW_PARAMS_C
        k = tl.load(params + _CANDIDATES).to(tl.int32)
        out, rng = out_ptr + row * PICKED_VALUES_C, rng_ptr + slot * RNG_VALUES_C
        _draw(vals_ptr + row * cols, idx_ptr + row * cols, params, rng, out, k, BLOCK, BLOCK, 1)


# ---- the host's side --------------------------------------------------------------------------------------


def argmax_splits(cols: int) -> int:
    """Chunks the arg-max cuts a `cols`-wide row into: a block each."""
    return triton.cdiv(cols, ARGMAX_CHUNK)


def argmax_scratch_size(cols: int) -> int:
    """f32 values of the arg-max's scratch: a best value, its index and a NaN flag a chunk, and a counter."""
    return 3 * argmax_splits(cols) + 1


def argmax_scratch(cols: int, device: torch.device | str) -> torch.Tensor:
    """The arg-max's scratch, allocated once (before a graph is captured): its counter starts at zero and
    every launch leaves it there."""
    return torch.zeros(argmax_scratch_size(cols), dtype=torch.float32, device=device)


def new_picked(device: torch.device | str, draws: int = 1) -> torch.Tensor:
    """A `picked` tensor: the token (or `draws` tokens) and the NaN flag a sampler writes."""
    return torch.zeros(draws + PICKED_VALUES - 1, dtype=PICKED_DTYPE, device=device)


def _feed_args(picked: torch.Tensor, ids: torch.Tensor | None, pos: torch.Tensor | None, draws: int = 1):
    if picked.dtype != PICKED_DTYPE or picked.numel() != draws + PICKED_VALUES - 1:
        raise ValueError(f"picked must be {draws + PICKED_VALUES - 1} {PICKED_DTYPE} values (`new_picked`)")
    if (ids is None) != (pos is None):
        raise ValueError("the step's input ids and position come together, or neither")
    # never read without FEED: the kernel is compiled without the writes
    return (picked, picked, False) if ids is None else (ids, pos, True)


def _row(logits: torch.Tensor) -> torch.Tensor:
    x = logits.view(-1)
    if x.stride(0) != 1:
        raise ValueError("logits must be one unit-stride row")
    return x


def argmax_token(
    logits: torch.Tensor,
    picked: torch.Tensor,
    scratch: torch.Tensor,
    *,
    ids: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
) -> None:
    """The greedy pick: picked = (the index of the largest logit, lowest on a tie; 1 if a logit is NaN, else
    0), one launch. With the decode step's `ids` and `pos`, the token is also written as the next input and
    the position advanced. `logits` is one row (f32 or f16); `scratch` is `argmax_scratch(cols)`.
    """
    x = _row(logits)
    cols = x.numel()
    need = argmax_scratch_size(cols)
    if scratch.dtype != torch.float32 or scratch.numel() < need:
        raise ValueError(f"argmax_token needs an f32 scratch of {need} values")
    ids_t, pos_t, feed = _feed_args(picked, ids, pos)
    _launch_argmax(x, picked, ids_t, pos_t, scratch, cols, 1, (0, 0, 0), feed)


def argmax_rows(logits: torch.Tensor, picked: torch.Tensor, scratch: torch.Tensor) -> None:
    """`argmax_token` for each row of `logits` (rows, cols) into the same row of `picked` (rows,
    PICKED_VALUES), one launch for them all: a batch's greedy picks. `scratch` is `argmax_scratch(cols)` a
    row, (rows, `argmax_scratch_size(cols)`) f32."""
    rows, cols = logits.shape
    need = argmax_scratch_size(cols)
    if logits.stride(1) != 1 or picked.shape != (rows, PICKED_VALUES) or picked.dtype != PICKED_DTYPE:
        raise ValueError(f"argmax_rows: unit-stride logits and ({rows}, {PICKED_VALUES}) int32 picks")
    if scratch.dtype != torch.float32 or scratch.dim() != 2 or scratch.shape[0] < rows or scratch.shape[1] < need:
        raise ValueError(f"argmax_rows needs an f32 scratch of {need} values a row")
    pitches = (logits.stride(0), picked.stride(0), scratch.stride(0))
    _launch_argmax(logits, picked, picked, picked, scratch[0], cols, rows, pitches, False)


def _launch_argmax(x, picked, ids, pos, scratch, cols: int, rows: int, pitches: tuple[int, int, int], feed: bool):
    """The arg-max's launch over `rows` rows `pitches` apart (logits, picks, scratch; a row's scratch laid out
    as `argmax_scratch_size` says)."""
    splits = argmax_splits(cols)
    vals = scratch[:splits]
    idxs = scratch[splits : 2 * splits].view(torch.int32)
    nans = scratch[2 * splits : 3 * splits].view(torch.int32)
    count = scratch[3 * splits : 3 * splits + 1].view(torch.int32)
    _argmax_kernel[(splits, rows)](
        x, picked, ids, pos, vals, idxs, nans, count, cols, *pitches,
        CHUNK=ARGMAX_CHUNK, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), FEED=feed,
        num_warps=ARGMAX_WARPS, **pdl.options(),
    )  # fmt: skip


def candidates(logits: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor) -> None:
    """The `vals.numel()` largest logits, best first, into `vals` (f32) and their indices into `idx` (int64);
    every logit, stably sorted, when that is the whole row (top-k off)."""
    x = _row(logits)
    k = vals.numel()
    if idx.numel() != k or vals.dtype != torch.float32 or idx.dtype != torch.int64 or not 0 < k <= x.numel():
        raise ValueError(f"candidates: {k} f32 values and int64 indices, at most the row's {x.numel()}")
    if k == x.numel():
        torch.sort(x, descending=True, stable=True, out=(vals, idx))
    else:
        torch.topk(x, k, sorted=True, out=(vals, idx))


def sample_tile(k: int) -> int:
    """The tile the sampling kernel scans `k` candidates in."""
    return max(SAMPLE_MIN_TILE, min(SAMPLE_TILE, triton.next_power_of_2(k)))


def pick_tile(k: int, draws: int) -> int:
    """The tile the draws are picked in: the scan's for one draw, narrower for many (each draw compares its
    target with every running weight of the tile)."""
    return max(SAMPLE_MIN_TILE, min(sample_tile(k), PICK_VALUES // draws))


def sample_token(
    vals: torch.Tensor,
    idx: torch.Tensor,
    params: torch.Tensor,
    rng: torch.Tensor,
    picked: torch.Tensor,
    *,
    ids: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
    draws: int = 1,
) -> None:
    """A seeded draw from the candidates (`candidates`: best first) under `params` (f32: temperature > 0,
    top-p in (0, 1]) and `rng` (int64: seed, counter; the counter advances by one a draw): picked = (the
    token, 1 if a logit is NaN, else 0). One launch of one program. `ids`, `pos`: as `argmax_token`.

    `draws` (a power of two, at most MAX_DRAWS) draws that many tokens, independent, at the counter's next
    values, into picked[:draws] with the flag at picked[draws]: many samples of one distribution from one
    launch, which is how the tests measure it.
    """
    k = vals.numel()
    if params.dtype != torch.float32 or params.numel() != PARAMS_VALUES:
        raise ValueError(f"params must be {PARAMS_VALUES} f32 values: temperature, top-p")
    if rng.dtype != torch.int64 or rng.numel() != RNG_VALUES:
        raise ValueError(f"rng must be {RNG_VALUES} int64 values: seed, counter")
    if draws < 1 or draws > MAX_DRAWS or draws & (draws - 1):
        raise ValueError(f"draws must be a power of two up to {MAX_DRAWS}, not {draws}")
    if draws > 1 and ids is not None:
        raise ValueError("only one draw feeds the next step")
    ids_t, pos_t, feed = _feed_args(picked, ids, pos, draws)
    tile = sample_tile(k)
    warps = max(1, min(SAMPLE_MAX_WARPS, tile // (kernels.WARP * SAMPLE_VALUES_A_THREAD)))
    _sample_kernel[(1,)](
        vals,
        idx,
        params,
        rng,
        picked,
        ids_t,
        pos_t,
        k,
        BLOCK=tile,
        PICK_BLOCK=pick_tile(k, draws),
        DRAWS=draws,
        FEED=feed,
        num_warps=warps,
        **pdl.options(),
    )


def sample_rows(
    logits: torch.Tensor,
    vals: torch.Tensor,
    idx: torch.Tensor,
    slots: torch.Tensor,
    params: torch.Tensor,
    rng: torch.Tensor,
    picked: torch.Tensor,
) -> None:
    """A batch's draws, every row's in one launch after one sort, so a captured step draws inside its graph:
    row r with slots[r] = s >= 0 draws from its logits under params[s] (f32: temperature > 0, top-p in (0, 1],
    candidates: its top-k, or the whole row) and rng[s] (int64: seed, counter; advanced by one) into picked[r],
    as `sample_token` draws from that many `candidates`; a row of slot -1 keeps picked[r].

    The rows are sorted whole (a stable descending sort: ties in index order, where `candidates`' top-k leaves
    them unordered) and each is scanned in the widest tile, the one `sample_token` takes for a whole vocabulary:
    a top-k row's total weight is summed in another order than `sample_token`'s narrower tile sums it, so its
    draw is the same but where u * total falls within an f32 rounding of a running weight."""
    rows, cols = logits.shape
    if vals.shape != (rows, cols) or idx.shape != (rows, cols) or picked.shape != (rows, PICKED_VALUES):
        raise ValueError(f"sample_rows: sorted values, indices of ({rows}, {cols}) and picks of ({rows}, 2)")
    if slots.dtype != torch.int32 or slots.numel() != rows:
        raise ValueError(f"slots must be {rows} int32 values")
    if params.dtype != torch.float32 or params.shape[-1] != ROW_PARAMS or rng.dtype != torch.int64:
        raise ValueError(f"params must be rows of {ROW_PARAMS} f32 values, rng of {RNG_VALUES} int64")
    torch.sort(logits, dim=1, descending=True, stable=True, out=(vals, idx))
    tile = sample_tile(cols)
    warps = max(1, min(SAMPLE_MAX_WARPS, tile // (kernels.WARP * SAMPLE_VALUES_A_THREAD)))
    _sample_rows_kernel[(rows,)](vals, idx, slots, params, rng, picked, cols, BLOCK=tile, num_warps=warps,
                                 **pdl.options())  # fmt: skip

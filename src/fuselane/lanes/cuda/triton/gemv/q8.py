"""Decode GEMV on int8 activations (the lane's `activations=int8`): y (1, n) = x (1, k) @ W^T, x held as int8
codes under one f32 scale a 32-value block, W as checkpoint bytes.

Why: with f32 activations a 4-bit weight costs ~6.8 instructions in the loop (decode, float conversion, two
FMAs), which holds Q4_K to ~60 % of the H200's memory rate (`fast`). Here four codes meet four int8
activations in one `dp4a` (a 4-way byte dot product into an int32): a Q4_K word of eight codes is two masks
and two dp4a, and the scales are applied once a 16-value run, in f32. The weights are read as `fast`
reads them (its `load_chunk`, tiles, chunks and register prefetch), but Q4_K's 16-byte header and run of codes,
and the activation's 16 codes they meet, are each one 128-bit load whose four words stay in the thread
(`int8_words.ld4`): loaded as [N, G, 4] tensors, Triton spread the words over four lanes and gathered them
back through shared memory before every dp4a chain (sm_90 SASS of the 8B's down projection: 35 barriers -> 5, 72
registers -> 32; H200 7B decode 382 -> 395 tok/s, 8B 347 -> 343). Q6_K's runs are 16-aligned as the
device keeps its blocks (`run/stored.py`: a row's 208-byte blocks, then their d's), so each 16-byte run of ql and
qh is one 128-bit load too; in the file's 210-byte blocks every other block's runs sat 2 bytes past a word, five
aligned 32-bit loads funnel-shifted into four words (`int8_words.ld_run`). Q8_0's codes are kept apart from their
d's (`run/stored.py`), each half of a block one 128-bit load too. Q5_0 keeps `load_chunk`'s loads.

The activation (`Q8Acts`): `q` int8 (k,) codes, `d` f32 (k / 32,) scales (largest |x| of the block / 127, a
code is round(x / d)), and `s` f32 (k / 16,) each 16 values' d * (sum of codes). A format with a minimum or a
code bias (Q4_K's dmin * min, Q6_K's 32, Q5_0's 16) subtracts it once a run as bias * s, so codes enter the
dp4a unsigned, as stored. `quantize` writes a Q8Acts from f32 rows (`quant.py`).

Under Triton's interpreter (`TRITON_INTERPRET=1`, CI without a GPU) the word-level pieces run without PTX
(`int8_words`), summing exactly what the instructions sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, QK_K, Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import pdl
from fuselane.lanes.cuda.triton.gemv import fast, q8_bodies
from fuselane.lanes.cuda.triton.gemv.fast import (
    K_RUNS,
    LANES,
    PAIR,
    PAIR_RUNS,
    QUAD,
    q4_k_scales_of,
    q6_k_runs,
)
from fuselane.lanes.cuda.triton.gemv.int8_words import dot16, dot16_of, ld4, words
from fuselane.lanes.cuda.triton.gemv.layout import (
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q6_K,
    FMT_Q8_0,
    HALF_WORD_BITS,
    NIBBLE,
    NIBBLE_BITS,
    const,
)
from fuselane.lanes.cuda.triton.gemv.parts import (
    Part,
    check_glu_out,
    check_rows,
    part_base,
    part_formats,
    parts_args,
    row_pointers,
    store_parts,
)
from fuselane.lanes.cuda.triton.gemv.q8_raw import GROUPS, GROUPS_C, HALF_QK_C, NEW_BODIES_C, raw_chunk
from fuselane.lanes.cuda.triton.gemv.q8_tiles import tile_of
from fuselane.lanes.cuda.triton.gemv.weight_loads import PINNED, fence
from fuselane.lanes.cuda.triton.quant import CODES_ALIGN, Q8Acts, check_acts

LOW_NIBBLES = const(0x0F0F0F0F)  # the low nibble of each byte of a word
CRUMBS = const(0x03030303)  # the low 2 bits of each byte
FIFTH_BITS = const(0x10101010)  # bit 4 of each byte
# x * SPREAD puts bit i (0..3) of x at bit 8i + 4 (shifts 4, 11, 18, 25; the other products miss the mask)
SPREAD = const((1 << 4) | (1 << 11) | (1 << 18) | (1 << 25))
Q6_CRUMB_STEP, Q6_HIGH_CRUMB = const(2), const(4)  # Q6_K: crumbs of run r at bits 2 (r // 2) (low nibbles), + 4 (high)
Q6_BIAS, Q5_BIAS = const(32.0), const(16.0)
QK_C, QK_K_C = const(QK), const(QK_K)
WORD_VALUES = const(4)  # int8 codes a 32-bit word
PINNED_C = const(PINNED)  # `FENCE`'s value under weight_loads=ahead
# Each format's values a unit (its groups a unit: `q8_raw.GROUPS`); `q8_bodies` holds the formats after the first four
UNIT_VALUES = {Format.Q4_K: QK_K, Format.Q6_K: QK_K, Format.Q8_0: QK, Format.Q5_0: QK} | q8_bodies.UNIT_VALUES
FORMATS = frozenset(GROUPS)
# formats whose group r of a unit meets values 64 (r // 2) + 16 (r % 2) + 0..15 and the 16 from 32 on
# (as a constexpr map of every format to a flag: compiled Triton indexes a constexpr dict, but has no `in`)
K_PAIRS_C = const({int(f): f in {Format.Q4_K} | q8_bodies.K_PAIR_FORMATS for f in Format})
# formats whose group r of (four) meets values 128 (r // 2) + 16 (r % 2) + 32 j + 0..15, j = 0..3 (`q8_bodies`)
K_QUADS_C = const({int(f): f in q8_bodies.K_QUAD_FORMATS for f in Format})
QUAD_GROUPS = q8_bodies.QUAD
# Chunks of weights a program has in flight while it sums one (1 or 2). Two chunks: 0.6B 0.912 -> 0.826 ms,
# 0.5B 0.621 -> 0.597 ms a step, where a row is a few chunks; no change on the 8B (2.868 / 2.866 ms), whose
# programs are not short of loads in flight.
PREFETCH_DEPTH = 2


LOAD_BYTES = CODES_ALIGN  # `ld4`'s load: Q4_K and Q6_K rows and the activation codes must start at a multiple


# --- the activations a group meets -----------------------------------------------------------------------------


@triton.jit
def _run(xq, xd, xs, first, BLOCK_N: tl.constexpr, live):
    """The 16 activations from value `first` ([1, G], a multiple of 16): 4 words [N, G, 4], their block's
    scale and their 16-value sum d * codes, [1, G] each ([N, G] where xq, xd and xs are [N, 1] pointers, a
    row's own activation each); 0 where not live."""
    words = (xq.to(tl.pointer_type(tl.int32)) + first // WORD_VALUES)[:, :, None] + tl.arange(0, QUAD)[None, None, :]
    words += tl.zeros([BLOCK_N, 1, 1], tl.int32)  # the weights' layout: the rows' loads are one broadcast
    a = tl.load(words, mask=live[:, :, None], other=0)
    return a, tl.load(xd + first // QK_C, mask=live, other=0.0), tl.load(xs + first // HALF_QK_C, mask=live, other=0.0)


@triton.jit
def _run_of(xq, xd, xs, first, BLOCK_N: tl.constexpr, live):
    """`_run` with the four words held apart ([N, G] each, `ld4`); where not live they are read at value 0
    (the caller drops those groups' sums) and the scale and sum are 0."""
    at = tl.where(live, first, 0) // WORD_VALUES + tl.zeros([BLOCK_N, 1], tl.int32)
    a0, a1, a2, a3 = ld4(xq.to(tl.pointer_type(tl.int32)) + at, False)
    d = tl.load(xd + first // QK_C, mask=live, other=0.0)
    return a0, a1, a2, a3, d, tl.load(xs + first // HALF_QK_C, mask=live, other=0.0)


@triton.jit
def _quad_runs_of(xq, xd, xs, first, BLOCK_N: tl.constexpr, live):
    """The four runs a Q3_K / Q2_K group meets (values `first` + 32 j, j = 0..3, `first` run t = (first // 16)
    % 2 of its block) as four `_run_of`s: each run's words (`ld4`), but the four blocks' scales in one 128-bit
    load and their sums in two (sum 2 j + t of the eight from the first block's), where four runs of `_run_of`
    take eight 32-bit loads. Where not live they are read at value 0; the caller drops those groups' sums."""
    at = tl.where(live, first, 0) + tl.zeros([BLOCK_N, 1], tl.int32)
    q = xq.to(tl.pointer_type(tl.int32)) + at // WORD_VALUES
    d0, d1, d2, d3 = ld4(xd.to(tl.pointer_type(tl.int32)) + at // QK_C, False)
    sub = at // HALF_QK_C
    odd = (sub % 2) == 1
    sums = xs.to(tl.pointer_type(tl.int32)) + (sub - sub % 2)
    e0, e1, e2, e3 = ld4(sums, False)
    f0, f1, f2, f3 = ld4(sums + WORD_VALUES, False)
    s0, s1 = _f32(tl.where(odd, e1, e0)), _f32(tl.where(odd, e3, e2))
    s2, s3 = _f32(tl.where(odd, f1, f0)), _f32(tl.where(odd, f3, f2))
    step = QK_C // WORD_VALUES  # words from one block's codes to the next's
    run0 = ld4(q, False) + (_f32(d0), s0)
    run1 = ld4(q + step, False) + (_f32(d1), s1)
    run2 = ld4(q + 2 * step, False) + (_f32(d2), s2)
    return run0 + run1 + run2 + ld4(q + 3 * step, False) + (_f32(d3), s3)


@triton.jit
def _f32(bits):
    """The f32 whose bits `bits` (int32, as `ld4` returns them) are."""
    return bits.to(tl.float32, bitcast=True)


# --- per format: a chunk's activations, then its sum a group ([N, G] f32) ------------------------------------


@triton.jit
def _live(u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr):
    """[1, G]: whether each group of the chunk at unit u0 is in the row (a partial last chunk's are not)."""
    G: tl.constexpr = CHUNK * GROUPS_C[FMT]
    if FMT == FMT_Q6_K:
        unit, _, _ = q6_k_runs(u0, CHUNK)
    else:
        unit = tl.arange(0, G) // (G // CHUNK) + u0
    return (unit < N_UNITS)[None, :]


@triton.jit
def _first_values(u0, FMT: tl.constexpr, CHUNK: tl.constexpr):
    """[1, G]: the first activation value each group of the chunk at unit u0 meets (its low run's)."""
    if K_PAIRS_C[FMT]:  # group g: run r = g % 8, pair r // 2, half r % 2 of the pair's low sub-block
        g = tl.arange(0, CHUNK * K_RUNS)
        r = g % K_RUNS
        first = (g // K_RUNS + u0) * QK_K_C + (r // PAIR_RUNS) * (2 * QK_C) + (r % PAIR_RUNS) * HALF_QK_C
    elif K_QUADS_C[FMT]:  # group g: r = g % 4, half r // 2, run r % 2 of its first 32 values
        g = tl.arange(0, CHUNK * QUAD_GROUPS)
        r = g % QUAD_GROUPS
        first = (g // QUAD_GROUPS + u0) * QK_K_C + (r // PAIR_RUNS) * (4 * QK_C) + (r % PAIR_RUNS) * HALF_QK_C
    elif FMT == FMT_Q6_K:  # group g: ql run r of half h
        unit, half, r = q6_k_runs(u0, CHUNK)
        first = unit * QK_K_C + half * (4 * QK_C) + r * HALF_QK_C
    else:  # a 32-value block (or IQ4_XS's sub-block) a group
        first = (tl.arange(0, CHUNK * GROUPS_C[FMT]) + u0 * GROUPS_C[FMT]) * QK_C
    return first[None, :]


@triton.jit
def chunk_acts(xq, xd, xs, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """The activations the chunk at unit u0 meets, as a tuple `_chunk_sum` takes: each group's low run and
    the run its other codes meet (Q4_K's high nibbles 32 on, Q6_K's 64 on, Q8_0's and Q5_0's 16 on), or the
    four runs a Q3_K / Q2_K group's crumbs meet (32 apart)."""
    live = _live(u0, FMT, N_UNITS, CHUNK)
    first = _first_values(u0, FMT, CHUNK)
    if K_PAIRS_C[FMT]:
        return _run_of(xq, xd, xs, first, BLOCK_N, live) + _run_of(xq, xd, xs, first + QK_C, BLOCK_N, live)
    elif K_QUADS_C[FMT]:  # a run of each of the four 32-value blocks of a half
        return _quad_runs_of(xq, xd, xs, first, BLOCK_N, live)
    elif FMT == FMT_Q6_K:
        return _run_of(xq, xd, xs, first, BLOCK_N, live) + _run_of(xq, xd, xs, first + 2 * QK_C, BLOCK_N, live)
    elif NEW_BODIES_C[FMT] or FMT == FMT_Q8_0:  # a block's two halves, held apart
        return _run_of(xq, xd, xs, first, BLOCK_N, live) + _run_of(xq, xd, xs, first + HALF_QK_C, BLOCK_N, live)
    else:
        return _run(xq, xd, xs, first, BLOCK_N, live) + _run(xq, xd, xs, first + HALF_QK_C, BLOCK_N, live)


@triton.jit
def _q4_k(raw, acts, CHUNK: tl.constexpr):
    """Q4_K: group g is run r = g % 8 of a unit's qs: 16 bytes of pair j = r // 2, its low nibbles values
    64j + 16 (r % 2) + 0..15 (sub-block 2j), its high ones 32 on (2j + 1)."""
    h0, h1, h2, h3, q0, q1, q2, q3 = raw
    a0, a1, a2, a3, da_lo, s_lo, b0, b1, b2, b3, da_hi, s_hi = acts
    d, dmin, scales, mins = q4_k_scales_of(h0, h1, h2, h3, CHUNK)
    lo = dot16_of(q0 & LOW_NIBBLES, q1 & LOW_NIBBLES, q2 & LOW_NIBBLES, q3 & LOW_NIBBLES, a0, a1, a2, a3, False)
    hi = dot16_of(
        (q0 >> NIBBLE_BITS) & LOW_NIBBLES, (q1 >> NIBBLE_BITS) & LOW_NIBBLES,
        (q2 >> NIBBLE_BITS) & LOW_NIBBLES, (q3 >> NIBBLE_BITS) & LOW_NIBBLES, b0, b1, b2, b3, False,
    )  # fmt: skip
    return q8_bodies.k_pair_sums(lo, hi, d, dmin, scales, mins, da_lo, s_lo, da_hi, s_hi)


@triton.jit
def _q6_k(raw, acts, CHUNK: tl.constexpr):
    """Q6_K: group g is ql run r of half h: low nibbles values 128h + 16r + 0..15, high ones 64 on; the top
    two bits of each are crumbs r // 2 and 2 + r // 2 of the half's qh bytes 16 (r % 2) + 0..15."""
    d, sc_lo, sc_hi, l0, l1, l2, l3, h0, h1, h2, h3 = raw
    a0, a1, a2, a3, da_lo, s_lo, b0, b1, b2, b3, da_hi, s_hi = acts
    _, _, r = q6_k_runs(0, CHUNK)
    shift = ((r // PAIR) * Q6_CRUMB_STEP)[None, :]
    lo = dot16_of(
        _q6_codes(l0, h0, shift), _q6_codes(l1, h1, shift), _q6_codes(l2, h2, shift), _q6_codes(l3, h3, shift),
        a0, a1, a2, a3, False,
    )  # fmt: skip
    up = shift + Q6_HIGH_CRUMB
    hi = dot16_of(
        _q6_codes(l0 >> NIBBLE_BITS, h0, up), _q6_codes(l1 >> NIBBLE_BITS, h1, up),
        _q6_codes(l2 >> NIBBLE_BITS, h2, up), _q6_codes(l3 >> NIBBLE_BITS, h3, up), b0, b1, b2, b3, False,
    )  # fmt: skip
    y_lo = lo.to(tl.float32) * da_lo - Q6_BIAS * s_lo
    y_hi = hi.to(tl.float32) * da_hi - Q6_BIAS * s_hi
    return d * (sc_lo.to(tl.float32) * y_lo + sc_hi.to(tl.float32) * y_hi)


@triton.jit
def _q6_codes(ql, qh, shift):
    """Four 6-bit codes a word: the low nibbles of `ql`'s bytes under the crumbs at `shift` of `qh`'s."""
    return (ql & LOW_NIBBLES) | (((qh >> shift) & CRUMBS) << NIBBLE_BITS)


@triton.jit
def _q8_0(raw, acts):
    """Q8_0: group g is block u0 + g, its bytes 0-15 and 16-31 signed codes (four words each)."""
    d, w0, w1, w2, w3, v0, v1, v2, v3 = raw
    a0, a1, a2, a3, da, _, b0, b1, b2, b3, _, _ = acts
    sumi = dot16_of(w0, w1, w2, w3, a0, a1, a2, a3, True) + dot16_of(v0, v1, v2, v3, b0, b1, b2, b3, True)
    return d * da * sumi.to(tl.float32)


@triton.jit
def _q5_0(raw, acts):
    """Q5_0: qs byte i holds the low 4 bits of value i (low nibble) and 16 + i (high one); bit v of qh is
    value v's fifth bit, spread to bit 4 of its byte."""
    d, qh, qs = raw
    a_lo, da, s_lo, a_hi, _, s_hi = acts
    qs = words(qs)
    t = tl.arange(0, QUAD)[None, None, :] * WORD_VALUES
    qh = qh[:, :, None]
    lo = (qs & LOW_NIBBLES) | ((((qh >> t) & NIBBLE) * SPREAD) & FIFTH_BITS)
    hi = ((qs >> NIBBLE_BITS) & LOW_NIBBLES) | ((((qh >> (t + HALF_WORD_BITS)) & NIBBLE) * SPREAD) & FIFTH_BITS)
    sumi = dot16(lo, a_lo, False) + dot16(hi, a_hi, False)
    return d * (sumi.to(tl.float32) * da - Q5_BIAS * (s_lo + s_hi))


@triton.jit
def _chunk_sum(acc, raw, acts, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """acc [N, G] += this chunk's sums a group (`chunk_sums`)."""
    return acc + chunk_sums(raw, acts, u0, FMT, N_UNITS, CHUNK, MASKED)


@triton.jit
def chunk_sums(raw, acts, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """[N, G]: this chunk's sums a group (its weights `raw`, its activations `acts`); in a partial chunk the
    missing units' stand-in weights (the row's last unit, read again) are dropped."""
    if FMT == FMT_Q4_K:
        y = _q4_k(raw, acts, CHUNK)
    elif FMT == FMT_Q6_K:
        y = _q6_k(raw, acts, CHUNK)
    elif FMT == FMT_Q8_0:
        y = _q8_0(raw, acts)
    elif NEW_BODIES_C[FMT]:
        y = q8_bodies.group_sums(raw, acts, FMT, CHUNK)
    else:
        tl.static_assert(FMT == FMT_Q5_0, "no int8 GEMV for this format")
        y = _q5_0(raw, acts)
    if MASKED:
        y = tl.where(_live(u0, FMT, N_UNITS, CHUNK), y, 0.0)
    return y


@triton.jit
def row_dots(w_a, w_b, xq, xd, xs, FMT: tl.constexpr, BLOCK_N: tl.constexpr, N_UNITS: tl.constexpr,
              CHUNK: tl.constexpr, FENCE: tl.constexpr, TWO: tl.constexpr, DEPTH: tl.constexpr,
              PDL: tl.constexpr, HOLD: tl.constexpr = False):  # fmt: skip
    """x . row for the tile's rows of `w_a` (and `w_b` where TWO), [N] f32 each (x one row's pointers, or [N, 1]
    pointers: each row of the tile its own activation row); the loop of
    `fast.row_dots`: each iteration loads the weights DEPTH chunks ahead (1 or 2), then sums this
    chunk's with its activations (`chunk_acts`, read once for both matrices where TWO). The first DEPTH chunks'
    loads are written before the wait for the kernel that wrote x (`pdl`). FENCE (`weight_loads`): a barrier
    between each prefetch and the sums after it; PINNED, the weights on the coherent path, which the barrier
    holds ahead, and one after the first chunks' loads too. HOLD: a barrier between the first chunks' loads and
    the wait too, so ptxas issues those loads before it (`pdl`: it hoists a wait above loads it may reorder);
    for a launch whose weights' addresses are ready before the launch before it ends (the mixture's down)."""
    CHUNKS: tl.constexpr = (N_UNITS + CHUNK - 1) // CHUNK
    PIN: tl.constexpr = FENCE == PINNED_C
    PARTIAL: tl.constexpr = N_UNITS % CHUNK != 0
    DEEP: tl.constexpr = DEPTH == 2 and CHUNKS >= 2
    G: tl.constexpr = CHUNK * GROUPS_C[FMT]
    raw_a = raw_chunk(w_a, 0, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 1, PIN)
    raw_b = raw_a
    acc_a = tl.zeros([BLOCK_N, G], tl.float32)
    acc_b = tl.zeros([1], tl.float32)  # a placeholder where not TWO
    if TWO:
        raw_b = raw_chunk(w_b, 0, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 1, PIN)
        acc_b = tl.zeros([BLOCK_N, G], tl.float32)
    if DEEP:  # the second chunk, in flight with the first
        mid_a = raw_chunk(w_a, CHUNK, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 2, PIN)
        mid_b = mid_a
        if TWO:
            mid_b = raw_chunk(w_b, CHUNK, FMT, N_UNITS, CHUNK, PARTIAL and CHUNKS == 2, PIN)
    if HOLD:
        tl.debug_barrier()
    pdl.wait(PDL)
    if PIN:  # the first chunks' loads issued before any sum (a kernel of one or two chunks has no loop)
        tl.debug_barrier()
    AHEAD: tl.constexpr = 2 * CHUNK if DEEP else CHUNK
    for c in range(0, CHUNKS - 2 if DEEP else CHUNKS - 1):
        u0 = c * CHUNK
        next_a = raw_chunk(w_a, u0 + AHEAD, FMT, N_UNITS, CHUNK, PARTIAL, PIN)
        if TWO:
            next_b = raw_chunk(w_b, u0 + AHEAD, FMT, N_UNITS, CHUNK, PARTIAL, PIN)
        if PIN:  # before the activations' loads too, so the sums that wait on them cannot pull ahead of it
            tl.debug_barrier()
        acts = chunk_acts(xq, xd, xs, u0, FMT, N_UNITS, BLOCK_N, CHUNK)
        if FENCE and not PIN:  # see fast.PREFETCH_FENCE (it holds only coherent loads: `weight_loads`)
            tl.debug_barrier()
        acc_a = _chunk_sum(acc_a, raw_a, acts, u0, FMT, N_UNITS, CHUNK, False)
        if TWO:
            acc_b = _chunk_sum(acc_b, raw_b, acts, u0, FMT, N_UNITS, CHUNK, False)
        if DEEP:
            raw_a, mid_a = mid_a, next_a
            if TWO:
                raw_b, mid_b = mid_b, next_b
        else:
            raw_a = next_a
            if TWO:
                raw_b = next_b
    last = (CHUNKS - 1) * CHUNK
    if DEEP:  # the chunk before the last, already loaded
        acts = chunk_acts(xq, xd, xs, last - CHUNK, FMT, N_UNITS, BLOCK_N, CHUNK)
        acc_a = _chunk_sum(acc_a, raw_a, acts, last - CHUNK, FMT, N_UNITS, CHUNK, False)
        raw_a = mid_a
        if TWO:
            acc_b = _chunk_sum(acc_b, raw_b, acts, last - CHUNK, FMT, N_UNITS, CHUNK, False)
            raw_b = mid_b
    acts = chunk_acts(xq, xd, xs, last, FMT, N_UNITS, BLOCK_N, CHUNK)
    y_a = tl.sum(_chunk_sum(acc_a, raw_a, acts, last, FMT, N_UNITS, CHUNK, PARTIAL), 1)
    y_b = y_a
    if TWO:
        y_b = tl.sum(_chunk_sum(acc_b, raw_b, acts, last, FMT, N_UNITS, CHUNK, PARTIAL), 1)
    return y_a, y_b


# --- kernels -----------------------------------------------------------------------------------------------------


@triton.jit
def parts_product(
    xq, xd, xs, parts, res,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    DEPTH: tl.constexpr, PDL: tl.constexpr, SECOND: tl.constexpr, FMT_B: tl.constexpr, N_UNITS_B: tl.constexpr,
    CHUNK_B: tl.constexpr, ROW_BYTES_B: tl.constexpr,
):  # fmt: skip
    """A launch in parts' program: its part's rows summed and stored with the part's epilogue. SECOND holds a
    bit for each part in the second format (FMT_B, its units, chunk and row bytes), 0 where every part is in
    FMT: a program's part is one format, so it takes one body, whole. Returns the part, for an epilogue of
    the kernel's own after it (`q8_rope`)."""
    part, rows, n, w = part_base(parts, BLOCK_N)
    if SECOND == 0:
        w_rows = row_pointers(w, rows, n, ROW_BYTES)
        y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, DEPTH, PDL)
    elif ((tl.full((), SECOND, tl.int32) >> part) & 1) != 0:
        w_rows = row_pointers(w, rows, n, ROW_BYTES_B)
        y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT_B, BLOCK_N, N_UNITS_B, CHUNK_B, FENCE, False, DEPTH, PDL)
    else:
        w_rows = row_pointers(w, rows, n, ROW_BYTES)
        y, _ = row_dots(w_rows, w_rows, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, False, DEPTH, PDL)
    store_parts(y, rows, part, n, parts, res, PARTS, BIAS, AT_ROW, HAS_RES)
    return part


@triton.jit
def _parts_kernel(
    xq, xd, xs, parts, res,
    FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    FENCE: tl.constexpr, PARTS: tl.constexpr, BIAS: tl.constexpr, AT_ROW: tl.constexpr, HAS_RES: tl.constexpr,
    DEPTH: tl.constexpr, SECOND: tl.constexpr, FMT_B: tl.constexpr, N_UNITS_B: tl.constexpr, CHUNK_B: tl.constexpr,
    ROW_BYTES_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    parts_product(
        xq, xd, xs, parts, res, FMT, N_UNITS, CHUNK, ROW_BYTES, BLOCK_N, FENCE, PARTS, BIAS, AT_ROW, HAS_RES, DEPTH,
        PDL, SECOND, FMT_B, N_UNITS_B, CHUNK_B, ROW_BYTES_B,
    )  # fmt: skip


@triton.jit
def _glu_kernel(xq, xd, xs, w_gate, w_up, n, out, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr,
                ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, n - 1).to(tl.int64) * ROW_BYTES
    w_g, w_u = w_gate + row_off, w_up + row_off
    gate, up = row_dots(w_g, w_u, xq, xd, xs, FMT, BLOCK_N, N_UNITS, CHUNK, FENCE, True, DEPTH, PDL)
    tl.store(out + rows, gate / (1.0 + tl.exp(-gate)) * up, mask=rows < n)


# --- launchers ---------------------------------------------------------------------------------------------------


def supports(fmt: Format | int, m: int, k: int) -> bool:
    """Whether these kernels take a product of `m` rows of `k` values in `fmt`: one row, a format above."""
    return m == 1 and fmt in FORMATS and k % UNIT_VALUES[Format(fmt)] == 0


# the alignment each format's loads need of its rows' start (Q4_K's header, runs and activations, Q6_K's runs and
# Q8_0's codes as the lane stores them: `ld4`)
ALIGN = {Format.Q4_K: LOAD_BYTES, Format.Q6_K: LOAD_BYTES, Format.Q8_0: LOAD_BYTES} | q8_bodies.ALIGN


def check_aligned(weights: Sequence[Tensor], fmt: Format) -> None:
    align = ALIGN.get(Format(fmt), 1)
    if any(w.data_ptr() % align for w in weights):
        raise ValueError(f"{Format(fmt).name} weights must start {align}-byte aligned (`ld4`)")


def tile_plan(
    fmt: Format, k: int, block_n: int | None, warps: int | None, per_thread: int | None, *, glu: bool = False,
    n: int | None = None,
) -> dict:  # fmt: skip
    """The launch's constexprs and warps at this module's tile for `n` rows of `k` values in `fmt` (`tile_of`),
    or at the tile given (each of its three a power of two; one left None takes the format's). A chunk is as
    many units as give each thread `per_thread` (row, group)s, at most the row's units rounded up to a power of
    two, as in `fast.launch_plan`."""
    fmt = Format(fmt)
    if fmt not in FORMATS:
        raise ValueError(f"no int8 GEMV for {fmt.name}")
    unit = UNIT_VALUES[fmt]
    if k < 1 or k % unit:
        raise ValueError(f"the int8 {fmt.name} GEMV takes rows of whole {unit}-value units, not {k} values")
    tile = tile_of(fmt, k, n, glu=glu)
    block_n, warps, per_thread = (given or t for given, t in zip((block_n, warps, per_thread), tile, strict=True))
    for name, v in (("block_n", block_n), ("warps", warps), ("per_thread", per_thread)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, not {v}")
    consts = dict(FMT=int(fmt), N_UNITS=k // unit, CHUNK=_chunk(fmt, k, block_n, warps, per_thread))
    consts |= {"ROW_BYTES": stored_row_bytes(fmt, k), "BLOCK_N": block_n}
    return consts | {"FENCE": fence(fast.PREFETCH_FENCE), "num_warps": warps, "DEPTH": PREFETCH_DEPTH}


def _chunk(fmt: Format, k: int, block_n: int, warps: int, per_thread: int) -> int:
    """Units a chunk: as many as give each thread `per_thread` (row, group)s, at most the row's units rounded
    up to a power of two."""
    units = k // UNIT_VALUES[fmt]
    return min(max(1, warps * LANES * per_thread // (block_n * GROUPS[fmt])), triton.next_power_of_2(units))


def gemv_q8_parts(x: Q8Acts, parts: Sequence[Part | tuple], fmt: Format | Sequence[Format], *,
                  residual: Tensor | None = None, block_n: int | None = None, warps: int | None = None,
                  per_thread: int | None = None) -> None:  # fmt: skip
    """One launch of up to four products reading the same quantized `x`; as `gemv_fast.gemv_fast_parts`
    (bias, a row of a table at a device position, residual into part 0). `fmt`: the parts' format, or each
    part's, of at most `kernels.GEMV_PARTS_FORMATS` (the first part's takes the launch's tile)."""
    plan, args, flags, tiles = parts_launch(x, parts, fmt, residual, block_n, warps, per_thread)
    _parts_kernel[(tiles,)](x.q, x.d, x.s, *args, **flags, **plan, **pdl.options())


def parts_launch(
    x: Q8Acts, parts: Sequence[Part | tuple], fmt: Format | Sequence[Format], residual: Tensor | None,
    block_n: int | None, warps: int | None, per_thread: int | None,
) -> tuple[dict, list, dict, int]:  # fmt: skip
    """A launch in parts on `x`, checked: its tile's plan (the first part's format's, with the second
    format's constants: `second_format`), its arguments after the activation, its flags and its programs
    (`parts.parts_args`)."""
    fmts = part_formats(fmt, len(parts))
    k = x.q.shape[-1]
    check_acts(x, k)
    for p, f in zip(parts, fmts, strict=True):
        check_aligned([Part(*p).w], f)
    n = sum(Part(*p).n for p in parts)
    plan = tile_plan(fmts[0], k, block_n, warps, per_thread, n=n)
    plan |= second_format(fmts, k, plan, per_thread or tile_of(fmts[0], k, n)[2])
    return plan, *parts_args(parts, fmts, k, plan["BLOCK_N"], x.d, residual)


def second_format(fmts: Sequence[Format], k: int, plan: dict, per_thread: int) -> dict:
    """The constants of a launch in parts' second format (SECOND: a bit for each part in it; 0, and the first
    format's constants, where there is none): its chunk at the launch's tile, as `tile_plan` makes one."""
    first = fmts[0]
    formats = set(fmts)
    if len(formats) > kernels.GEMV_PARTS_FORMATS:
        raise ValueError(f"a launch in parts takes at most {kernels.GEMV_PARTS_FORMATS} formats, not {len(formats)}")
    second = next((f for f in fmts if f is not first), first)
    if second not in FORMATS:
        raise ValueError(f"no int8 GEMV for {second.name}")
    if k % UNIT_VALUES[second]:
        raise ValueError(f"the int8 {second.name} GEMV takes rows of whole {UNIT_VALUES[second]}-value units")
    block_n, warps = plan["BLOCK_N"], plan["num_warps"]
    bits = sum(1 << i for i, f in enumerate(fmts) if f is not first)
    consts = dict(SECOND=bits, FMT_B=int(second), N_UNITS_B=k // UNIT_VALUES[second])
    consts |= {"CHUNK_B": _chunk(second, k, block_n, warps, per_thread), "ROW_BYTES_B": stored_row_bytes(second, k)}
    return consts


def gemv_q8(x: Q8Acts, w: Tensor, fmt: Format, n: int, k: int, out: Tensor, *, bias: Tensor | None = None,
            residual: Tensor | None = None, out_row: tuple[Tensor, int] | None = None, block_n: int | None = None,
            warps: int | None = None, per_thread: int | None = None) -> Tensor:  # fmt: skip
    """out = x @ W^T (+ bias) (+ residual) for the quantized activation `x` (1, k); see `gemv_q8_parts`."""
    if x.q.shape[-1] != k:
        raise ValueError(f"x has {x.q.shape[-1]} columns, the weights' rows {k}")
    one = [Part(w, n, out, bias, out_row)]
    gemv_q8_parts(x, one, fmt, residual=residual, block_n=block_n, warps=warps, per_thread=per_thread)
    return out


def gemv_q8_gate_up_glu(x: Q8Acts, w_gate: Tensor, w_up: Tensor, fmt: Format, n: int, k: int, out: Tensor, *,
                        block_n: int | None = None, warps: int | None = None,
                        per_thread: int | None = None) -> Tensor:  # fmt: skip
    """out (1, n) = SiLU(x @ Wg^T) * (x @ Wu^T) in one launch, for the quantized activation `x`."""
    fmt = Format(fmt)
    check_acts(x, k)
    check_rows(w_gate, fmt, n, k)
    check_rows(w_up, fmt, n, k)
    check_aligned([w_gate, w_up], fmt)
    check_glu_out(out, n)
    plan = tile_plan(fmt, k, block_n, warps, per_thread, glu=True)
    _glu_kernel[(triton.cdiv(n, plan["BLOCK_N"]),)](x.q, x.d, x.s, w_gate, w_up, n, out, **plan, **pdl.options())
    return out

"""The int8 GEMV's weight loads (`q8`): a chunk of a tile's rows as the dp4a bodies read it, each group's words
in one thread.

Why apart: the bodies (`q8.chunk_sums`) take what these return, and the loads are where a format's layout on
the device (`run/stored.py`: Q6_K's and Q8_0's rows split, their runs on 16 bytes) meets the 128-bit loads of
`int8_words`; the kernels (`q8`, `q8_rows`, `q8_epilogue`) reach them through `raw_chunk`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.triton.gemv import q8_bodies
from fuselane.lanes.cuda.triton.gemv.fast import (
    K_RUNS,
    Q6_QH_RUNS,
    Q6_RUN,
    Q6_RUNS,
    Q6_SUBS_HALF,
    RUN_BYTES,
    ld16,
    ld_once,
    load_chunk,
    q6_k_runs,
)
from fuselane.lanes.cuda.triton.gemv.int8_words import ld2, ld4, ld_run
from fuselane.lanes.cuda.triton.gemv.layout import (
    FMT_Q4_K,
    FMT_Q6_K,
    FMT_Q8_0,
    Q4_K_BYTES,
    Q4_K_QS,
    Q6_HIGH_SUBS,
    Q6_K_BYTES,
    Q6_K_QH,
    Q6_K_QL,
    Q6_K_SCALES,
    Q6_QH_HALF,
    Q6_QL_HALF,
    Q8_0_BYTES,
    Q8_0_QS,
    const,
    q6_k_d,
    q8_0_d,
)
from fuselane.lanes.cuda.triton.gemv.q8_bodies import DWORD_BYTES

HALF_QK_C = const(QK // 2)
# Q8_0 rows of a multiple of this many blocks (8 of 34 bytes) end on 16 bytes, so every block's codes start on 16
Q8_0_WIDE_ROW = const(q8_bodies.rows_on_16(Format.Q8_0))
# Each format's groups a unit (a thread's share of a chunk: see `q8.chunk_acts`); `q8_bodies` holds the formats
# after the first four
GROUPS = {Format.Q4_K: K_RUNS.value, Format.Q6_K: Q6_RUNS.value, Format.Q8_0: 1, Format.Q5_0: 1} | q8_bodies.GROUPS
GROUPS_C = const({int(f): g for f, g in GROUPS.items()})
# the formats of `q8_bodies`, as a constexpr map of every format (compiled Triton indexes a constexpr dict, but has
# no `in`)
NEW_BODIES_C = const({int(f): f in q8_bodies.FORMATS for f in Format})


@triton.jit
def _raw_q4_k(w_rows, u0, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr, PINNED: tl.constexpr):
    """Q4_K's raw chunk as `fast.load_chunk` reads it (each group's 16-byte header and 16-byte run of qs), but
    as eight [N, G] words, each group's in one thread (`ld4`)."""
    g = tl.arange(0, CHUNK * K_RUNS)
    unit = g // K_RUNS + u0
    if CLAMP:
        unit = tl.minimum(unit, N_UNITS - 1)
    blk = w_rows[:, None] + (unit * Q4_K_BYTES)[None, :]
    run = blk + ((g % K_RUNS) * RUN_BYTES + Q4_K_QS)[None, :]
    h0, h1, h2, h3 = ld4(blk.to(tl.pointer_type(tl.int32)), True, PINNED)
    q0, q1, q2, q3 = ld4(run.to(tl.pointer_type(tl.int32)), True, PINNED)
    return h0, h1, h2, h3, q0, q1, q2, q3


@triton.jit
def _raw_q6_k(w_rows, u0, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr, PINNED: tl.constexpr):
    """Q6_K's raw chunk: each group's (a ql run's) d, its two scales, and its 16 ql bytes and the 16 qh bytes
    of their crumbs as four [N, G] words each, in one thread: the device's blocks keep every run on 16 bytes
    (`run/stored.py`), so each run is one 128-bit load (`ld4`)."""
    unit, half, r = q6_k_runs(u0, CHUNK)
    if CLAMP:
        unit = tl.minimum(unit, N_UNITS - 1)
    blk = w_rows[:, None] + (unit * Q6_K_BYTES)[None, :]
    sc = (blk + (half * Q6_SUBS_HALF + r + Q6_K_SCALES)[None, :]).to(tl.pointer_type(tl.int8))
    ql = blk + (half * Q6_QL_HALF + r * Q6_RUN + Q6_K_QL)[None, :]
    qh = blk + (half * Q6_QH_HALF + (r % Q6_QH_RUNS) * Q6_RUN + Q6_K_QH)[None, :]
    if PINNED:  # `weight_loads=ahead`: its word loads, which ptxas keeps ahead of the barrier (`ld_run`)
        ql, qh = ld_run(ql, PINNED), ld_run(qh, PINNED)
    else:
        ql, qh = ld4(ql.to(tl.pointer_type(tl.int32)), True), ld4(qh.to(tl.pointer_type(tl.int32)), True)
    d = ld16(q6_k_d(w_rows[:, None], unit[None, :], N_UNITS), True)
    return (d, ld_once(sc), ld_once(sc + Q6_HIGH_SUBS)) + ql + qh


@triton.jit
def _raw_q8_0(w_rows, u0, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr, PINNED: tl.constexpr):
    """Q8_0's raw chunk: each group's (a block's) d and its 32 codes as eight [N, G] words, in one thread: the
    device keeps a row's codes 32 bytes a block and its d's after them (`run/stored.py`), so each half of a block
    is one 128-bit load (`ld4`; two 64-bit ones where a row's blocks are not a multiple of 8 and rows end on 8
    bytes), where the file's 34-byte blocks took sixteen 2-byte loads."""
    unit = tl.arange(0, CHUNK) + u0
    if CLAMP:
        unit = tl.minimum(unit, N_UNITS - 1)
    blk = w_rows[:, None] + (unit * Q8_0_BYTES + Q8_0_QS)[None, :]
    if N_UNITS // Q8_0_WIDE_ROW * Q8_0_WIDE_ROW == N_UNITS:  # rows of whole 16-byte units: codes on 16 bytes
        lo = ld4(blk.to(tl.pointer_type(tl.int32)), True, PINNED)
        hi = ld4((blk + HALF_QK_C).to(tl.pointer_type(tl.int32)), True, PINNED)
    else:  # rows end on 8 bytes (`kernels.ROW_ALIGN_BYTES`): a block's codes as four 64-bit loads
        lo = ld2(blk, PINNED) + ld2(blk + DWORD_BYTES, PINNED)
        hi = ld2(blk + HALF_QK_C, PINNED) + ld2(blk + HALF_QK_C + DWORD_BYTES, PINNED)
    return (q8_bodies.half_at(q8_0_d(w_rows[:, None], unit[None, :], N_UNITS)),) + lo + hi


@triton.jit
def raw_chunk(w_rows, u0, FMT: tl.constexpr, N_UNITS: tl.constexpr, CHUNK: tl.constexpr, CLAMP: tl.constexpr,
              PINNED: tl.constexpr = False):  # fmt: skip
    """A chunk's weight bytes: Q4_K's and Q6_K's held apart a group a thread (`_raw_q4_k`, `_raw_q6_k`), the
    others' as `load_chunk`. PINNED: the runs' loads take the coherent path (`weight_loads`)."""
    if FMT == FMT_Q4_K:
        return _raw_q4_k(w_rows, u0, N_UNITS, CHUNK, CLAMP, PINNED)
    elif FMT == FMT_Q6_K:
        return _raw_q6_k(w_rows, u0, N_UNITS, CHUNK, CLAMP, PINNED)
    elif FMT == FMT_Q8_0:
        return _raw_q8_0(w_rows, u0, N_UNITS, CHUNK, CLAMP, PINNED)
    elif NEW_BODIES_C[FMT]:
        return q8_bodies.raw_chunk(w_rows, u0, FMT, N_UNITS, CHUNK, CLAMP, GROUPS_C[FMT], PINNED)
    else:
        return load_chunk(w_rows, u0, FMT, N_UNITS, CHUNK, CLAMP)

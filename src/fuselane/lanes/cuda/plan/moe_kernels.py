"""The cuda lane's kernel facts for mixtures of experts: the grouped expert GEMM of a chunk and a decode step's
routing, gate/up and down launches.

As `kernels` (the facts of every other kernel, which these build on), the one place that says what shapes each
mixture kernel takes: the kernels size their launches from these values and the shim decides from the same
values whether a fused op has a launch. Each value is chosen for an H200 and says why beside it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import NamedTuple

from fuselane.gguf.formats import GRID_FORMATS, QK_K, Format
from fuselane.lanes.cuda.plan.kernels import GEMV_ROWS, ROWS_GEMV_FORMATS, WARP, pow2_at_least

# --- a chunk's mixture: the grouped GEMM (`triton/moe/grouped.py`) -----------------------------------------

# A chunk past the GEMV's rows multiplies its kept experts as a grouped GEMM: its (row, slot) pairs sorted by
# expert, each expert's pairs cut into tiles of MOE_GEMM_BLOCK_M, a program a tile by MOE_*_BLOCK_N weight
# rows, on the f16 tensor cores, a step of a K-quant's 256 values (or 128 of a 32-value format) at a time.
# 64 pairs by 128 weight rows a tile, measured on the H200 at Qwen3-30B-A3B's widths (a 512-row chunk routes
# 4,096 pairs to 128 experts, 32 on average; `benchmarks/moe_prefill.py`, Q4_K, eight warps, one stage): a
# layer's three launches 1,458 us at 64 x 128, against 1,622 at 32 x 128, 2,048 at 64 x 64, 2,248 at 32 x 64
# and 3,055 at 16 x 64 (RESULTS.md). 64 pairs take the warp group's wgmma; ptxas reports spills at 64 pairs
# (460-610 bytes a thread at 64 x 64, `benchmarks/moe_registers.py`), which cost less than the smaller tiles'
# extra weight reads.
MOE_GEMM_BLOCK_M = 64
MOE_GATE_UP_BLOCK_N = 128
MOE_DOWN_BLOCK_N = 128
MOE_GEMM_WARPS = 8
MOE_GEMM_STAGES = 1
# ...its step is the decode's own (a K-quant's super-block, four 32-value blocks): `MoeTile.step` only says so.
MOE_UNIT_STEP = QK_K


class MoeLaunch(enum.Enum):
    """The grouped GEMM's two launches: both products and the SwiGLU, or the down products and the combine."""

    GATE_UP = "gate_up"
    DOWN = "down"


class MoeTile(NamedTuple):
    """A grouped expert GEMM's launch: pairs a tile, weight rows a tile, warps, the pipeliner's stages, and the
    word decode's values a step (`words.STEPS`; a format the word decode does not take ignores it)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    step: int


# The formats the word decode takes (`triton/moe/words.py`): their loads are 32-bit words and, with the routing
# launch's row scales (`route.RowScales`: no branch in the k loop), Triton's pipeliner stages them (cp.async)
# `stages` steps ahead. Each (format, launch) has its own tile, timed on the H200 by
# `benchmarks/moe_prefill.py --sweep` (a 512-row chunk, the launch alone, µs; the best of ten candidates, then
# the runner-up): Qwen3-30B-A3B (128 experts top-8, d 2,048, ffn 768: gate/up 2,048-value rows, down 768) and
# DeepSeek-V2-Lite (64 experts top-6, d 2,048, ffn 1,408: down 1,408-value rows, not whole 256-value steps,
# so a candidate of 256 values a step ran at 128 there, `grouped.format_consts`).
# - gate/up Q4_K, both models: 64 x 64, four warps, two stages, 128 values a step: 309.8 (Qwen3; 64 x 128
#   eight warps one stage 256 a step 338.8) and 285.9 (V2-Lite; 64 x 64 eight warps three stages 331.0),
#   against 362.3 / 339.8 at the tile before (64 x 64, eight warps, two stages).
# - down Q4_K, Qwen3: 64 x 256, eight warps, two stages, 128: 301.7 (64 x 128 eight warps three stages 312.8;
#   the tile before, 64 x 128 eight warps two stages, 368.3).
# - down Q6_K, Qwen3: 64 x 128, eight warps, one stage, a whole super-block a step: 465.0 (64 x 64 four warps
#   two stages 700.0; the tile before 741.9); replaced after the H100 sweep below.
# - down Q5_0, V2-Lite: 64 x 64, four warps, two stages, 128: 342.2 (64 x 128 eight warps one stage 373.4; the
#   tile before 390.9).
# - down Q8_0, V2-Lite: 64 x 128, eight warps, one stage, 128 (timed as "256 a step", which 1,408 values take
#   as 128): 342.2 (64 x 64 four warps two stages 437.1; the tile before 484.9).
# A (format, launch) not timed takes its launch's default: gate/up the tile both models' Q4_K gate/up won; down
# 64 x 128, eight warps, one stage, 128 a step, within 16 % of the best of every down column timed (348.2,
# 465.0, 373.4, 342.2), where every other candidate was 50 % or more over the best of some column.
# Compiled for sm_90 (`benchmarks/moe_registers.py`, ptxas; Qwen3's widths, V2-Lite's 1,408 for Q8_0 / Q5_0):
# gate/up 64 x 64 in four warps 168 registers (Q4_K), 245-254 (Q5_0, Q8_0, Q6_K), none spilled; down Q4_K
# 64 x 256 255 and 312 bytes spilled a thread, Q6_K 64 x 128 one stage 255 and 260, Q8_0 28, Q5_0 20: the
# timings above are with those spills.
# Swept on an H100 at Qwen3-30B-A3B's widths (2026-12-07; µs a launch, against the tile each took before):
# - MXFP4 (an `MXFP4_MOE` file's experts): gate/up 64 x 64, four warps, one stage, 128 a step 524.0 (577.9);
#   down 64 x 128, four warps, two stages, 128 a step 441.7 (489.0; 255 registers and 280 stack bytes a
#   thread, sm_90: timed so).
# - Q4_0: gate/up 64 x 64, four warps, one stage, 128 324.6 (425.0); down 64 x 128, four warps, two stages,
#   128 312.4 (411.1).
# - IQ4_XS: gate/up as Q4_0's 529.6 (534.4); down as Q4_0's 393.8 (540.3).
# - Q2_K gate/up 64 x 64, four warps, one stage, 256 a step 329.5 (401.6); Q3_K down as Q4_0's 317.2 (421.7).
# - Q5_K gate/up as Q4_0's 328.8 (411.4).
# - Q6_K down 64 x 64, four warps, one stage, 128 407.2 against 563.9 at its H200-timed tile above (the same
#   sweep's 64 x 128, eight warps, one stage, 128 413.2).
# One stage won every gate/up column and 64 x 128 in four warps two stages every 16-code-byte and Q3_K down
# column. IQ4_NL (Q4_0's 16 code bytes a block, a table's values) is not swept: it takes the defaults. The
# unit decode spilled or filled the registers (sm_90, Qwen3-30B-A3B's widths, a thread: Q4_0 / MXFP4 255
# registers and 752 / 792 stack bytes in the gate/up launch; IQ4_XS, Q2_K, Q3_K 254-255 and none, their down
# 144-192 bytes); the words decode's `benchmarks/RESULTS.md` lists (2026-12-07, third).
MOE_WORDS_FORMATS = frozenset(
    {
        *(Format.Q4_K, Format.Q5_K, Format.Q6_K, Format.Q8_0, Format.Q5_0),
        *(Format.Q4_0, Format.IQ4_NL, Format.IQ4_XS, Format.Q2_K, Format.Q3_K, Format.MXFP4),
    }
)
MOE_WORDS_TILES = {
    (Format.Q4_K, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 2, 128),
    (Format.Q4_K, MoeLaunch.DOWN): MoeTile(64, 256, 8, 2, 128),
    (Format.Q6_K, MoeLaunch.DOWN): MoeTile(64, 64, 4, 1, 128),
    (Format.Q5_0, MoeLaunch.DOWN): MoeTile(64, 64, 4, 2, 128),
    (Format.Q8_0, MoeLaunch.DOWN): MoeTile(64, 128, 8, 1, 128),
    (Format.MXFP4, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 1, 128),
    (Format.MXFP4, MoeLaunch.DOWN): MoeTile(64, 128, 4, 2, 128),
    (Format.Q4_0, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 1, 128),
    (Format.Q4_0, MoeLaunch.DOWN): MoeTile(64, 128, 4, 2, 128),
    (Format.IQ4_XS, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 1, 128),
    (Format.IQ4_XS, MoeLaunch.DOWN): MoeTile(64, 128, 4, 2, 128),
    (Format.Q2_K, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 1, 256),
    (Format.Q3_K, MoeLaunch.DOWN): MoeTile(64, 128, 4, 2, 128),
    (Format.Q5_K, MoeLaunch.GATE_UP): MoeTile(64, 64, 4, 1, 128),
}
MOE_WORDS_DEFAULT = {
    MoeLaunch.GATE_UP: MOE_WORDS_TILES[Format.Q4_K, MoeLaunch.GATE_UP],
    MoeLaunch.DOWN: MoeTile(64, 128, 8, 1, 128),
}

# The grid and ternary formats' tile (`grid.values.grid_tile`, half a super-block a step): a value costs its group's
# table gather, so a tile decodes few rows against many pairs. Eight warps: at four the down launch took 255
# registers and 56 stack bytes a thread (sm_90, Qwen3-30B-A3B's widths, IQ3_S), at eight 211-219 and none. Untimed.
MOE_GRID_TILE = MoeTile(64, 64, 8, 1, 128)


# A chunk whose experts take few pairs each (at most MOE_FEW_PAIRS on average) mostly fills a 64-pair tile with
# padding: Qwen3-Next-80B-A3B's 512 experts, top-10, meet ~10 of a 512-row chunk's pairs each. Its tiles, timed
# on the H200 at those widths (`benchmarks/moe_prefill.py --model qwen3-next-80b-a3b --sweep`, µs a launch,
# against the table's above): gate/up Q4_K 16 x 64, four warps, two stages 643.9 (799.1); down Q4_K 16 x 128,
# four warps, two stages 444.6 (762.8); down Q6_K 64 x 64, four warps, one stage, 128 a step 1,015.5 (1,349.5;
# its 16-pair tiles 1,199-1,796).
MOE_FEW_PAIRS = 16
MOE_FEW_PAIRS_TILES = {
    (Format.Q4_K, MoeLaunch.GATE_UP): MoeTile(16, 64, 4, 2, 128),
    (Format.Q4_K, MoeLaunch.DOWN): MoeTile(16, 128, 4, 2, 128),
    (Format.Q6_K, MoeLaunch.DOWN): MoeTile(64, 64, 4, 1, 128),
}


def moe_gemm_tile(fmt: Format, launch: MoeLaunch, pairs_an_expert: float | None = None) -> MoeTile:
    """The tile of a grouped expert GEMM's `launch` of experts in `fmt`: the word decode's table (its timed tile,
    else its launch's default; with at most MOE_FEW_PAIRS pairs an expert on average, the few pairs' tile where
    one was timed) for a format it takes, else the unit decode's one tile."""
    fmt = Format(fmt)
    few = pairs_an_expert is not None and pairs_an_expert <= MOE_FEW_PAIRS
    if few and (fmt, launch) in MOE_FEW_PAIRS_TILES:
        return MOE_FEW_PAIRS_TILES[fmt, launch]
    if fmt in MOE_WORDS_FORMATS:
        return MOE_WORDS_TILES.get((fmt, launch), MOE_WORDS_DEFAULT[launch])
    if fmt in GRID_FORMATS:
        return MOE_GRID_TILE
    down = launch is MoeLaunch.DOWN
    block_n = MOE_DOWN_BLOCK_N if down else MOE_GATE_UP_BLOCK_N
    return MoeTile(MOE_GEMM_BLOCK_M, block_n, MOE_GEMM_WARPS, MOE_GEMM_STAGES, MOE_UNIT_STEP)


# The next norm a chunk's down launch ends with is taken in chunks of this many values of a tile's rows, so
# a tile's 64 rows of it hold 32 f32 registers a thread of eight warps.
MOE_NORM_CHUNK = 128


# --- a decode step's mixture (`triton/moe/down.py`, `route.py`) ---------------------------------------------

# The down launch's program under int8 activations takes a few rows of the model's width, and every kept
# expert's same rows, as one int8 product tile of MOE_DOWN_TILE weight rows: slots x rows (slot-major; the
# slots the kept experts rounded up to a power of two, the ones past them reading the last expert's rows again
# from cache and summed as 0; `moe_down_rows`). So a program's loads of all its experts are in flight at once,
# not one expert's after another's (each behind its id's load), and the row's k loop is the GEMV's own. 32
# rows at eight warps are a (row, 16-value group) a thread for the K formats' eight groups a super-block
# (`gemv.q8.tile_plan`); Qwen3-30B-A3B (2,048 x 768 Q4_K, eight experts): four rows of each, 512 programs for
# 132 SMs, three super-blocks a row. A tile of 64 rows (Qwen3-Next's ten experts, four rows) took 186
# registers a thread against 48, one block a SM.
MOE_DOWN_TILE = 32
MOE_DOWN_WARPS = 8
MOE_DOWN_PER_THREAD = 1
# Its weights are read on the coherent path with a barrier after them (`weight_loads.PINNED`), so all of a
# row's chunks are in flight before the first sum (`triton/moe/down.py`), except in these formats, where that
# tile passes 64 registers a thread (ptxas sm_90, Qwen3-30B-A3B's widths: Q5_K 54 -> 72) and four blocks of
# eight warps no longer fit a SM's registers: 396 of the 512 programs resident at once, not all.
MOE_DOWN_UNPINNED = frozenset({Format.Q5_K})
# A folded shared expert's SwiGLU in the kept experts' gate/up launch (`triton/moe/shared.py`): in f32
# products (False), or, where its gate/up are the kept experts' format and the activation is int8, as the
# kept experts' own int8 tiles (True). The f32 products' registers are the whole launch's (sm_90, Q4_K over a
# 2,048-wide input: 146 a thread against 86 without the expert, 88 with it in int8 tiles, from the cubin by
# `benchmarks/moe_registers.py --decode --shared 512`). Qwen3-Next-80B-A3B on the H200, with the score's
# row still a 32-lane tile: the launch alone 21.4 µs in f32 products, 17.7 in int8 tiles (8.3 without the
# expert); the replayed decode step 3.864 ms against 3.671 (`benchmarks/profile_decode.py`).
MOE_SHARED_INT8 = True


class MoeDown(enum.Enum):
    """Where a decode step's down launch reads what its programs' ends wait on (`triton/moe/down.py`), timed
    one against the other by `benchmarks/moe_decode.py --variant`. Both sum the same terms in the same order
    but one: the residual, added before the slots' sum or after it (the contract's f32 roundings either way);
    the norm is the last program's (`fast_norm.norm_last`), whose sum of squares keeps a fixed order, so a
    launch's bits do not depend on which program ends last."""

    # the route weights and the residual read after the products' sum over their groups (sm_90 SASS: behind
    # that reduction's barrier, one more round trip to L2 before a program's store and its count)
    SERIAL = "old"
    # the route weights read with the ids (before the wait for the launch before), the residual right after
    # the wait (`moe/down_rows.py`): both round trips under the products', none between the last dp4a and the
    # store (`tests/cuda_kernels/test_moe_decode_sass.py`)
    READ_AHEAD = "new"


MOE_DOWN_VARIANT = MoeDown.READ_AHEAD
# Under it, chunks of a row's weights a program has in flight while it sums one (`moe/down_rows.py`), by format:
# three where a thread's registers stay within 64 (four blocks of eight warps a SM: all 512 programs of
# Qwen3-30B-A3B's or DeepSeek-V2-Lite's launch resident at once; ptxas sm_90, depth 2 -> 3: Qwen3-30B-A3B's
# Q4_K 48 -> 48, Q6_K 63 -> 63, DeepSeek-V2-Lite's Q5_0 52 -> 60, Q8_0 56 -> 70), so Qwen3-30B-A3B's three
# chunks a row are all read before the wait for the launch before, and DeepSeek-V2-Lite's Q5_0 row of six
# chunks waits on two round trips, not three; the GEMV's two (`gemv.q8.PREFETCH_DEPTH`) elsewhere.
MOE_DOWN_MAX_DEPTH = 3
MOE_DOWN_DEEP = frozenset({Format.Q4_K, Format.Q6_K, Format.Q5_0})

# A decode step's routing program takes this many of the router's rows (experts): the router is a few
# thousand values by a hundred or so experts, and the GEMV's own tile (eight rows a block of eight warps) left
# Qwen3-30B-A3B's 128 x 2,048 router 16 programs for 132 SMs, each streaming 64 KB. One row a program
# (eight warps, one step of the row's 2,048 values) puts the whole router in flight at once. A few rows' programs
# keep the GEMV's tile: each reads its block's rows of x (up to GEMV_ROWS) for its router rows; a chunk past
# them takes the tensor-core tile (MOE_ROUTE_CHUNK_*, below) where its router is in a float format.
MOE_ROUTE_ONE_ROW_EXPERTS = 1
MOE_ROUTE_ONE_ROW_WARPS = 8


# A chunk's routing product (past the GEMV's rows, a float router) as tensor-core tiles instead: a program takes
# MOE_ROUTE_CHUNK_ROWS rows by MOE_ROUTE_CHUNK_EXPERTS router rows, MOE_ROUTE_CHUNK_K values a step staged
# MOE_ROUTE_CHUNK_STAGES steps ahead (cp.async), `tl.dot` in three TF32 products (`tf32x3`: each f32 operand
# split into a TF32 and the TF32 of its rest, the rest's product dropped: about f32's own rounding, where one TF32
# product keeps 10 bits and can swap two experts' ranks that f32 keeps apart). The GEMV's tile (eight rows by
# eight router rows, on the CUDA cores) took Qwen3-30B-A3B's 512 rows as 1,024 programs, each a chain of L2 round
# trips for 128 KB in one block a SM (197 registers), and re-read the 1 MB router 64 times: 86.2 us (H200,
# `benchmarks/moe_prefill.py`). At 16 x 32 the same chunk is 128 programs, one wave of 132 SMs, each streaming
# 384 KB (its rows and its router rows, 50 MB from L2 in all, the router 32 times) through shared memory, 0.8
# GFLOP of TF32 products in all. Sixteen rows keep a block's ranking (its last program's arg-max passes over
# [16, experts], `route._rank_block`, and its sort's places, `_block_places`) short; a block's rows' largest
# values are split among its programs. The routing launches of a Qwen3-30B-A3B layer take at most 191 registers
# a thread and no stack (sm_90, `compile_check --usage`). Not yet timed: the estimate is ~15 us (the product
# ~3-5 us, the blocks' ranking ~4 and the last block's sort ~6, each tail a few L2 round trips).
MOE_ROUTE_CHUNK_ROWS = 16
MOE_ROUTE_CHUNK_EXPERTS = 32
MOE_ROUTE_CHUNK_K = 64
MOE_ROUTE_CHUNK_WARPS = 4
MOE_ROUTE_CHUNK_STAGES = 3
MOE_ROUTE_CHUNK_PRECISION = "tf32x3"
MOE_ROUTE_CHUNK_FORMATS = frozenset({Format.F32, Format.F16, Format.BF16})

# The most experts (a power of two) a routing row ranks by counting, for each expert, those ahead of it in one
# experts x experts comparison (a reduction; 64 comparisons a thread of eight warps at 128), instead of the
# top-k's k arg-max passes, each two block reductions (an arg-max and the kept probability's pick) that the
# one program ranking a row walks one after another: Qwen3-30B-A3B's 8 of 128, 16 reductions -> 1. Past it
# the comparison grows as the square (512 experts: 1,024 a thread) and the passes stay. A decode step's row
# only (a block of one row): a block of a chunk's rows keeps the passes, whose launch holds its products'
# sums for eight rows and spilled more with the comparison (ptxas sm_90, Qwen3-30B-A3B: 16 -> 56 stack bytes).
MOE_RANK_BY_COUNT_EXPERTS = 128
# The most values of a [rows, experts] tile a thread of a block's ranking holds (`route._rank_block`): the block
# walks its rows as many at a time as keep it there (`moe_rank_rows`), the places of its sort carried from one
# group of rows to the next. A Qwen3-30B-A3B block (16 rows of 128 experts over four warps: 16 values) takes 98-128
# registers and no stack; Qwen3-Next-80B-A3B's 512 experts, 16 rows at once (64 values), took 255 registers and
# 704 stack bytes a thread (sm_90, `compile_check --usage`), in the launch whose product programs share them.
MOE_RANK_VALUES = 16


def moe_rank_rows(row_block: int, experts_block: int, warps: int) -> int:
    """Rows of a block the ranking takes at a time: as many as hold `MOE_RANK_VALUES` of the [rows, experts]
    tile a thread (powers of two, so a whole number of groups), one at least."""
    return max(1, min(row_block, MOE_RANK_VALUES * warps * WARP // experts_block))


def moe_down_slots(k: int) -> int:
    """Slots of a decode down program's product tile for `k` kept experts: `k` rounded up to a power of two."""
    return pow2_at_least(k)


# Kept experts not a power of two in number (Qwen3-Next's ten, DeepSeek-V2's six) leave part of each tile to
# the slots past them: 6 of 16 at ten, each re-reading the last expert's rows. Packed, a program takes
# MOE_DOWN_TILE // k rows instead, each (row, expert) an entry of the tile and only the tile's last few idle:
# at ten, three rows (30 of 32 entries) where the slots take two, 683 programs for a 2,048-wide row against
# 1,024; at six, five rows against four. The same kernel either way (`moe_down_entries`). Timed at the 80B-A3B's
# widths (benchmarks/RESULTS.md, 2026-12-03): Q4_K 12.00 -> 10.42 us, Q6_K 22.14 -> 17.47.
MOE_DOWN_PACKED = True


def moe_down_rows(k: int, tile: int = MOE_DOWN_TILE, packed: bool | None = None) -> int:
    """Rows of the model's width a decode down program takes for `k` kept experts: its tile's (MOE_DOWN_TILE
    weight rows, or `tile`: a benchmark's alternative) over the slots, or over the experts themselves where
    `packed` (MOE_DOWN_PACKED where not given)."""
    packed = MOE_DOWN_PACKED if packed is None else packed
    return max(1, tile // (k if packed else moe_down_slots(k)))


def moe_down_entries(k: int, rows: int) -> int:
    """(row, expert) entries of a decode down program's product tile of `rows` rows a program: every row's `k`
    experts, rounded up to a power of two (the tile itself where the slots are)."""
    return pow2_at_least(rows * k)


def moe_down_depth(fmt: Format) -> int:
    """Chunks in flight a decode down program keeps under MoeDown.READ_AHEAD: MOE_DOWN_MAX_DEPTH in the
    formats of MOE_DOWN_DEEP, two (the int8 GEMV's) in the others."""
    return MOE_DOWN_MAX_DEPTH if fmt in MOE_DOWN_DEEP else 2


def moe_route_tile(rows: int) -> tuple[int, int] | None:
    """(router rows a program, warps) of a routing launch of `rows` rows; None where it takes the GEMV's tile."""
    return (MOE_ROUTE_ONE_ROW_EXPERTS, MOE_ROUTE_ONE_ROW_WARPS) if rows == 1 else None


def moe_route_chunk(fmt: Format, rows: int) -> bool:
    """Whether a routing launch of `rows` rows by a router in `fmt` takes the tensor-core tile
    (MOE_ROUTE_CHUNK_*): a chunk past the GEMV's rows, a float router."""
    return rows > GEMV_ROWS and Format(fmt) in MOE_ROUTE_CHUNK_FORMATS


def moe_grouped(rows: int, formats: Iterable[Format] = ()) -> bool:
    """Whether a mixture of `rows` rows multiplies its experts (in `formats`) as the grouped GEMM: past the
    GEMV's rows, or a chunk's or a batch's fewer rows where no f32 GEMV decodes an expert matrix's format
    (Q2_K, Q3_K, IQ4_NL, IQ4_XS: a step's one row multiplies them on the int8 GEMV)."""
    return rows > GEMV_ROWS or (rows > 1 and any(Format(f) not in ROWS_GEMV_FORMATS for f in formats))


def moe_tiles_bound(pairs: int, experts: int, block_m: int) -> int:
    """The most tiles of `block_m` pairs `pairs` pairs sorted by expert can take, however they route: each
    expert's last tile may be partial, so at most one more than the whole tiles a program each."""
    return math.ceil(pairs / block_m) + experts


def moe_down_launch(d: int, dff: int, k: int, sdff: int) -> tuple[int, int]:
    """A decode mixture's down launch under int8 activations (`triton/moe/down.py`): (programs, threads a
    program). A program takes `moe_down_rows(k)` rows of the model's width for every kept expert at once, a
    product tile of MOE_DOWN_TILE weight rows in MOE_DOWN_WARPS warps, its last program norming the row;
    a folded shared expert (`sdff` wide; 0 for none) adds no program: each adds its down rows' product,
    the expert's SwiGLU and sigmoid having been written by the gate/up launch (`triton/moe/shared.py`), so
    `sdff` does not change the launch either. `dff` does not change the launch: a program walks an expert's row
    in chunks of the int8 GEMV's plan (`gemv.q8.tile_plan`).
    """
    return math.ceil(d / moe_down_rows(k)), MOE_DOWN_WARPS * WARP


# A decode step's routing inside the launch of the projection whose norm the router reads (knob
# `route_in_norm=on`, `triton/moe/norm_route.py`): each program of the add + norm GEMV (int8 or f32) adds its
# rows' share of every expert's score, and the launch's last programs sum the shares in two levels. A program
# holds its rows' router columns (experts x rows, read before its wait) through its product's loop: at most
# MOE_ROUTE_IN_NORM_EXPERTS experts (a power of two), 256 x the GEMV's 4 rows over its 64 threads at the fewest,
# 16 values a thread; Qwen3-Next's 512 keep the routing launch. The router is a float matrix (the tensor-core
# tile's formats, read as values). Measured slower than the routing launch (benchmarks/RESULTS.md, 2026-12-07,
# fourth), so off by default.
MOE_ROUTE_IN_NORM_EXPERTS = 256
MOE_ROUTE_IN_NORM_FORMATS = MOE_ROUTE_CHUNK_FORMATS
# Values of the shares a thread of a summing program holds a pass (`norm_route._sum_shares`).
MOE_ROUTE_SHARE_VALUES = 16


def moe_route_in_norm(experts: int, router_fmt: Format) -> bool:
    """Whether a decode step's routing by `experts` experts of a router in `router_fmt` runs in the launch of
    the projection whose norm it reads."""
    return pow2_at_least(experts) <= MOE_ROUTE_IN_NORM_EXPERTS and Format(router_fmt) in MOE_ROUTE_IN_NORM_FORMATS


def moe_route_groups(programs: int) -> tuple[int, int]:
    """(programs a group, groups) of a launch of `programs` programs that routes in its norm: groups of about
    sqrt(programs) (a power of two), so the groups' last programs and the launch's last each sum about as many
    rows of shares."""
    group = pow2_at_least(math.isqrt(max(programs - 1, 0)) + 1)
    return group, math.ceil(programs / group)


def moe_route_share_rows(most: int, experts_block: int, warps: int) -> int:
    """Rows of shares a summing program takes a pass: as many as hold MOE_ROUTE_SHARE_VALUES a thread (a power of
    two), one at least, at most `most` rounded up to a power of two."""
    return max(1, min(pow2_at_least(most), MOE_ROUTE_SHARE_VALUES * warps * WARP // experts_block))

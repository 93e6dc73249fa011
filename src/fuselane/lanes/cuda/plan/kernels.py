"""The cuda lane's kernel facts: the one place that says what shapes each Triton kernel takes (a mixture's
kernels' in `moe_kernels`, which builds on these).

The kernels size their launches from these values and the shim decides from the same values whether a fused
op has a launch, so a fusion the optimizer builds is always one a kernel runs. Each value is chosen for an
H200 (Hopper, sm_90: warps of 32 lanes, at most 1024 threads a block, 227 KiB of shared memory a block) and
says why beside it. Chip-specific quantities (SM count, shared memory) come from the knobs' `Chip`, never
from here.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

from fuselane.gguf.formats import LAYOUTS, QK, QK_K, Format
from fuselane.lanes.cuda.plan.knobs import Activations
from fuselane.numerics import contract

# --- the machine -----------------------------------------------------------------------------------------

WARP = 32  # lanes a warp: every NVIDIA GPU since Kepler
MAX_BLOCK_THREADS = 1024  # the most threads one block may have (every compute capability since 2.0)
MAX_BLOCK_WARPS = MAX_BLOCK_THREADS // WARP  # 32

# --- quantized activations -------------------------------------------------------------------------------

# Values under one scale of a quantized activation: the kernels quantize exactly as the numerics contract
# says, and a 32-value block is one warp's 32 lanes, one value a lane, so a block's largest |value| is one
# warp reduction.
QBLOCK = contract.QBLOCK

# --- the weights' layout on the device --------------------------------------------------------------------

# Bytes a block of these formats takes on the device, where the file's block is not whole 16-byte units: the
# lane copies each block to the start of a block of this size (the rest zero), so every block, and every field
# and 16-byte run at a 16-byte offset in it, starts on 16 bytes. A Q3_K block (110 bytes: hmask 32, qs 64,
# scales 12, d 2) takes 112: its int8 GEMV reads a group's scales and d, its qs run and its hmask run as three
# 128-bit loads, where the file's layout (every other block 2 bytes past a word) took 17 loads of 1-4 bytes.
# H200, the 7B's widths (benchmarks/RESULTS.md, 2026-12-05): the gate/up GLU 28.7 -> 20.2 us, the down product
# 22.9 -> 16.3 us, for 1.8 % more bytes of Q3_K matrices.
# A Q6_K block (210 bytes: ql 128, qh 64, scales 16, d 2) is split instead (`ROW_TAIL_D`): a row keeps its
# blocks' first 208 bytes one after another, then its blocks' d's, 2 bytes each, then zeros to a 16-byte end, so
# every run of ql and qh is 16-aligned at no cost but that padding (4-12 bytes a row at the Qwen widths). In whole
# 224-byte blocks its down product ran 16 % faster (H200, 7B widths) but every Q6_K matrix took 6.7 % more memory,
# past the workspace's 5 % share on a Q6_K file.
# A Q8_0 block (34 bytes: d 2, qs 32) is split the same way: a row keeps its blocks' 32 codes one after another,
# then their d's, so each block's codes are two 128-bit loads where the file's layout took sixteen 2-byte ones
# (sm_90 SASS at the 7B's widths, `benchmarks/gemv_sass.py`: the down product 12.2 -> 3.5 instructions and 2.9 ->
# 0.56 global loads a dp4a; the gate/up GLU 163 -> 47 loads, 784 -> 624 instructions, 96 -> 48 registers; H100,
# the 7B Q8_0's decode +14 %). Its rows end on 8 bytes, not 16: a row of a multiple of 128 values then needs no
# padding (Qwen2.5-0.5B's 896 would take 8 bytes a row on 16, 1.2 MB on its head, which cost the model's 512-row
# prompt chunks their share), and the int8 GEMV reads rows that do not end on 16 as four 64-bit loads a block.
# Q2_K's 84-byte blocks (scales 16, qs 64, d, dmin) were split too, their d and dmin after the row (rows to 16
# bytes): the GLU's loads 122 -> 74 (sm_90 SASS, the 7B's widths), but its decode only 449.4 -> 453.2 tok/s (H100,
# the 7B in Q2_K), and the rows' padding (8 bytes a row at 1,536 values) left Qwen2.5-1.5B's 256-row prompt chunks
# out of the share: kept as the file has them (benchmarks/RESULTS.md, 2026-12-06, second).
# Q4_0's and IQ4_NL's 18-byte blocks (d, then 16 bytes of codes) are split as Q8_0's, rows to 8 bytes, so a block's
# codes are one 128-bit load (two 64-bit ones where a row does not end on 16) where the file's layout took five
# 32-bit loads and four funnel shifts; IQ4_XS's 136-byte blocks keep their 8-byte header (d, scales_h, scales_l)
# after the row, so each of its 16-byte runs is one 128-bit load where it took two 64-bit ones.
STORED_BLOCK_BYTES = {
    Format.Q3_K: 112, Format.Q6_K: 208, Format.Q8_0: 32, Format.Q4_0: 16, Format.IQ4_NL: 16, Format.IQ4_XS: 128,
}  # fmt: skip
# Formats whose blocks' f16 scale d (and the fields after it up to these bytes: IQ4_XS's scales) is kept after a
# row's blocks (bytes a block), not in each block
ROW_TAIL_D = {Format.Q6_K: 2, Format.Q8_0: 2, Format.Q4_0: 2, Format.IQ4_NL: 2, Format.IQ4_XS: 8}
# A row of a ROW_TAIL_D format ends on this many bytes, so the next row's runs start aligned for its loads
ROW_ALIGN_BYTES = {Format.Q6_K: 16, Format.Q8_0: 8, Format.Q4_0: 8, Format.IQ4_NL: 8, Format.IQ4_XS: 16}


def stored_block_bytes(fmt: Format) -> int:
    """Bytes from one block of `fmt` to the next on the device (`STORED_BLOCK_BYTES`, else the file's)."""
    return STORED_BLOCK_BYTES.get(Format(fmt), LAYOUTS[Format(fmt)].nbytes)


def stored_offset(fmt: Format, field: str) -> int:
    """The byte offset of `field` in a block of `fmt` as the device keeps it: the file's, less the d's bytes where a
    `ROW_TAIL_D` format's d, kept after the row, came before it (Q8_0's codes start a stored block)."""
    lay = LAYOUTS[Format(fmt)]
    at = lay.field(field).offset
    tail = ROW_TAIL_D.get(Format(fmt))
    if tail is None:
        return at
    if kept_after_row(fmt, field):
        raise ValueError(f"{Format(fmt).name}'s {field} is kept after its row's blocks, not in a block")
    return at - tail if lay.field("d").offset < at else at


def kept_after_row(fmt: Format, field: str) -> bool:
    """Whether `field` of a block of `fmt` is kept after its row's blocks on the device (a `ROW_TAIL_D` format's
    d, and IQ4_XS's scales with it), not in the block."""
    tail = ROW_TAIL_D.get(Format(fmt))
    if tail is None:
        return False
    lay = LAYOUTS[Format(fmt)]
    d_at = lay.field("d").offset
    return d_at <= lay.field(field).offset < d_at + tail


def stored_row_bytes(fmt: Format, n_values: int) -> int:
    """Bytes a row of `n_values` values in `fmt` takes on the device: whole blocks of `stored_block_bytes`, and
    for a `ROW_TAIL_D` format the row's d's after them and the row padded to `ROW_ALIGN_BYTES`."""
    values = LAYOUTS[Format(fmt)].values
    if n_values % values:
        raise ValueError(f"{Format(fmt).name} rows are whole blocks of {values} values, not {n_values}")
    blocks = n_values // values
    tail = ROW_TAIL_D.get(Format(fmt))
    if tail is None:
        return blocks * stored_block_bytes(fmt)
    align = ROW_ALIGN_BYTES[Format(fmt)]
    return -(-blocks * (stored_block_bytes(fmt) + tail) // align) * align


def stored_span_bytes(fmt: Format, n_values: int) -> int:
    """Bytes from a block of `fmt` to the one `n_values` values on in its row (a span of whole blocks)."""
    values = LAYOUTS[Format(fmt)].values
    if n_values % values:
        raise ValueError(f"{Format(fmt).name} spans are whole blocks of {values} values, not {n_values}")
    return n_values // values * stored_block_bytes(fmt)


# --- products --------------------------------------------------------------------------------------------

# A product of at most this many rows runs as a GEMV: each lane keeps a partial sum per row in registers and
# the weights stream through once. Past eight rows the register file runs out and the weights' reuse
# across rows pays for tensor-core tiles (llama.cpp's MMVQ stops at eight columns for the same reason).
GEMV_ROWS = 8
# Rows of a mixture's prefill chunk in a session (llama.cpp's ubatch): its grouped expert GEMM cuts each expert's
# (row, slot) pairs into tiles, and at the session's 256 rows Qwen3-30B-A3B's 128 experts meet 16 pairs each. One
# chunk of 512 took 30.4 ms where two of 256 took 41.0 (H200, Q4_K_M: pp512 16,826 against 12,486 tok/s);
# DeepSeek-V2-Lite's latent mixture 24.4 ms against two of 21.1; Qwen3-Next-80B-A3B's 512 experts meet ~5 pairs
# each in 256 rows, and two chunks decoded every expert's weights twice (pp512 2,085). The dense models keep the
# session's chunk: their GEMMs take 256 rows well.
MOE_CHUNK_ROWS = 512
# Rows of a prefill chunk in a session under `prefill=f16-scratch`: each chunk decodes every matrix to f16 again,
# so a 512-token prompt (llama.cpp's ubatch) in one chunk decodes them once rather than twice.
SCRATCH_CHUNK_ROWS = 512
# The fewest rows a chunk is cut to where the workspace share cannot hold a 512-row chunk's arena beside the
# scratch (`run/workspace.chunk_rows`): a chunk's time on a small model is its launches and its matrices' decode,
# nearly whatever its rows, so two chunks take about twice one. Qwen2.5-0.5B Q4_K_M (H200, pp512): 512 rows and
# the pair in four slabs 113,915 tok/s; 256 rows whole 94,476, in two slabs 88,914, in four 65,030, which is still
# 1.5x llama.cpp's 42,900; 128 rows would fall under it.
SCRATCH_LEAST_ROWS = 256
# A sampled draw's candidate on the device: its f32 value and its int64 index (`decode.DeviceSampler._sampling`);
# a vocabulary's worth is held beside a chunk's workspace
CANDIDATE_BYTES = 4 + 8

# Where a buffer the lane carves into parts starts each part (the weights' upload, a step's activation arena):
# at the caching allocator's block alignment, which every kernel's pointers had when each tensor was a block.
PART_ALIGN_BYTES = 512
# Values (f16) of that scratch: a matrix past it is decoded and multiplied a slab of its rows at a time (a gated
# pair, a slab of each side by side). Measured on a 7B Q4_K_M's 512-row chunk (H200): every matrix whole (1.09 GB,
# the output's rows) 20.3 ms; 64 MiB 22.2 ms at 4.4 % over the file and cache; 32 MiB 22.9 ms at 3.6 %; 16 MiB
# 26.7 ms (each slab's launches start to cost more than its product). With the decode's tiles below
# (`DEQUANT_TILES`, 2026-12-03): 64 MiB 19.4 ms at 4.5 %, 32 MiB 21.1 ms at 3.8 %. A model whose layers'
# largest product (a gated pair) is less takes that, and a model whose share below does not hold it less
# (`run/workspace`).
F16_SCRATCH_VALUES = 32 * 2**20
# What a model may take on the GPU beyond its weights and its caches, as a share of them: the arena, the outputs,
# cuBLAS's workspace, the scratch and a product's f16 operands of a chunk (`run/workspace` sizes the scratch to it).
WORKSPACE_SHARE = 0.05
# The fewest slabs a layer's largest product is never cut past to meet that share at a chunk's rows: a 0.5B's
# gated pair whole 160,218 tok/s, in two slabs 155,402, in four 113,915 (H200, pp512, 2026-12-04). Where four do
# not fit, the lane tries fewer rows (`SCRATCH_LEAST_ROWS`), and where nothing fits the scratch keeps the product
# whole.
SCRATCH_MOST_SLABS = 4
# cuBLAS's workspace as torch takes it on Hopper (CUBLAS_WORKSPACE_CONFIG unset), and the ones the lane asks for
# where that leaves the scratch short of its most: 4 MiB, at which the small shapes' prompts measured the same
# (0.5B pp512 161,132 against 156,704) and the 7B's 3.8 % slower, which is why it is not asked for always; then
# none, where only that lets the scratch take fewer slabs: the 0.5B's pair whole lost 5.7 % with none (151,946
# against 161,069), in four slabs nothing (113,609 against 113,915), the 1.5B Q2_K's in four nothing.
CUBLAS_DEFAULT_WORKSPACE_BYTES = 32 * 2**20
CUBLAS_LEAN_WORKSPACE = ":4096:1"
CUBLAS_NO_WORKSPACE = ":0:0"
# The whole-matrix decode's tile (`gemv/epilogue.dequantize`: values a program, warps), by format, and the tile
# of a format not named. A thread's share of the tile pays its program's index arithmetic once: at 8 values a
# thread (2,048 values, 8 warps, the old tile of every format) a Q4_K value took 35 instructions (sm_90), and
# the decode ran on the issue rate, not on HBM. Measured on an 18,944 x 3,584 matrix to f16 (H200,
# `benchmarks/dequant_sweep.py`, RESULTS.md 2026-12-03), bytes read and written a second at the old tile ->
# this one: Q4_K 2.60 -> 3.76 TB/s, Q5_K 2.16 -> 3.60, Q6_K 2.14 -> 3.02 (its runs' tile, `_q6_k_tile`),
# Q8_0 3.85 -> 3.81, Q4_0 2.85 -> 3.14, Q2_K 2.10 -> 2.83, Q3_K 1.91 -> 2.62, IQ4_XS 1.36 -> 2.16; the
# floats are copies, best at the old tile (4.17 TB/s for F16).
DEQUANT_TILE = (4096, 4)
DEQUANT_TILES: dict[Format, tuple[int, int]] = {
    Format.Q4_K: (8192, 4),
    Format.Q5_K: (8192, 4),
    Format.Q6_K: (8192, 4),
    Format.F32: (2048, 8),
    Format.F16: (2048, 8),
    Format.BF16: (2048, 8),
}


def dequant_tile(fmt: Format) -> tuple[int, int]:
    """(values a program, warps) of `fmt`'s whole-matrix decode."""
    return DEQUANT_TILES.get(fmt, DEQUANT_TILE)


# A slab's rows, in whole steps of this many: cuBLAS's f16 kernels take an output whose row pitch is a multiple
# of 8 values, and fall to slower ones otherwise (a 7B's down product in slabs of 885 rows took twice as long).
F16_SLAB_STEP = 128

# The output tile of a tensor-core GEMM: 128 outputs wide, the N tile Triton's Hopper wgmma path runs at
# full rate for int8 and f16 operands.
GEMM_TILE_N = 128

# A gated pair on the tensor cores puts the gate's and the up product's tiles side by side in one 128-wide
# tile: 64 outputs of each, so the SwiGLU of a column pair happens in the tile's epilogue.
GEMM_PAIR_TILE_N = GEMM_TILE_N // 2

# The most products one launch takes in parts (a GEMM's or a GEMV's): each part's bounds, weights, scales and
# output are kernel arguments, and Triton compiles a kernel per argument signature, so the number of parts is
# fixed when the kernel is built: four covers a layer's q, k and v and one more (a gate).
GEMM_PARTS = 4

# The block formats whose f32-activation GEMV decodes the weights in registers, block by block. Q8_0 has a
# kernel of its own (its int8 words are multiplied as stored, a row a warp); Q2_K, Q3_K, IQ4_NL and IQ4_XS
# have none yet: a decode step multiplies them on the int8 GEMV (`INT8_GEMV_FORMATS`) only.
DECODED_FORMATS = frozenset({Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1, Format.Q4_K, Format.Q5_K, Format.Q6_K})

# The formats the int8 GEMV (dp4a over the activation's int8 codes, `triton/gemv/q8.py`) multiplies, and the
# most rows of weights a program of it takes in each (its tiles' BLOCK_N, by a row's length, are these or a
# divisor of them): the QKV GEMV that turns the query and key in its epilogue turns a head in whole tiles, so
# a head of a multiple of these rows is whole rows of programs at any width. A product in any other format
# reads the f32 activation.
INT8_GEMV_TILE_ROWS = {
    Format.Q4_K: 4, Format.Q6_K: 4, Format.Q8_0: 4, Format.Q5_0: 4, Format.Q5_K: 4, Format.Q4_0: 4, Format.Q4_1: 4,
    Format.Q5_1: 4, Format.IQ4_NL: 4, Format.IQ4_XS: 4, Format.Q3_K: 2, Format.Q2_K: 2,
}  # fmt: skip
INT8_GEMV_FORMATS = frozenset(INT8_GEMV_TILE_ROWS)
# ...its rows whole super-blocks of the format (a K format's or IQ4_XS's 256 values, the others' 32): the run
# a program reads at a time.
SUPER_BLOCK_FORMATS = frozenset({Format.Q4_K, Format.Q6_K, Format.Q5_K, Format.IQ4_XS, Format.Q3_K, Format.Q2_K})
# The formats the GEMV by checkpoint rows decodes (`triton/gemv/formats.py`, its `SLOTS`): any rows, any
# width, a block of the lane's threads a tile.
ROWS_GEMV_FORMATS = frozenset({
    Format.Q4_K, Format.Q5_K, Format.Q6_K, Format.Q8_0, Format.Q4_0, Format.Q4_1, Format.Q5_0, Format.Q5_1,
    Format.F32, Format.F16, Format.BF16,
})  # fmt: skip
# ...and these, a value at a time (`formats._dot_values`): slower than their int8 GEMV, so taken only for a
# step's one row that reads f32 (activations=dequant), where a chunk's decode and cuBLAS took two launches a
# product and an f16 copy of the matrix (`rows_gemv`).
VALUE_GEMV_FORMATS = frozenset({Format.Q2_K, Format.Q3_K, Format.IQ4_NL, Format.IQ4_XS})
# The formats the whole-matrix decode on the device (`gemv/epilogue.dequantize`) takes: the prefill products'
# f16 copies and scratch come from it, so a checkpoint in any of them prefills on cuBLAS.
DEQUANT_FORMATS = ROWS_GEMV_FORMATS | VALUE_GEMV_FORMATS
# The one-row f32 GEMV's formats (`triton/gemv/fast.py`, its `GROUPS`): its add + norm epilogue, like the
# int8 GEMV's, has the last program walk the norm's row in chunks re-read from L2, so it norms any width; only
# the GEMV by checkpoint rows (`triton/gemv/rows.py`) holds the row in its block's registers.
FAST_GEMV_FORMATS = frozenset({Format.Q4_K, Format.Q6_K, Format.Q8_0, Format.Q5_0, Format.F16, Format.BF16})

# A decoded GEMV met one row at a time takes four rows a warp when the product is wide: the activation, held
# in registers, is read once for four weight rows.
ROWS_A_WARP_WIDE = 4
# ...its rows at least this long: split four ways (eight lanes a row) each lane still takes at least four
# 32-value blocks of a row, enough loads in flight to keep the memory system busy (8 * 4 * 32 = 1024).
WIDE_K = (WARP // ROWS_A_WARP_WIDE) * 4 * QBLOCK
# ...and at least this many outputs: at four rows a warp and four warps a block a narrower product has
# fewer than 16 blocks for 132 SMs, and needs a warp a row for parallelism instead.
WIDE_N = 256

# Warps of a block of a decoded GEMV: eight at a row a warp; four at four rows a warp, whose threads each
# hold four rows' partial sums and decoded weights, so fewer of them fit the register file.
GEMV_BLOCK_WARPS_ONE_ROW = 8
GEMV_BLOCK_WARPS_FOUR_ROWS = 4
# The most rows an f32 decode GEMV's tile takes: the GEMV by rows' four a warp over four warps (a row a warp over
# eight: 8); the tile-streaming GEMV's are at most 8 (`triton/gemv/fast.py` checks at import). All are powers of
# two, so a head whose width is a multiple of this is whole tiles, which the f32 QKV GEMV that turns its query
# and key in its epilogue needs (`triton/gemv/f32_rope.py`).
F32_GEMV_MOST_TILE_ROWS = ROWS_A_WARP_WIDE * GEMV_BLOCK_WARPS_FOUR_ROWS


def f32_turning_gemv(fmt: Format, m: int) -> str | None:
    """Which f32 GEMV multiplies a QKV product of `m` rows in `fmt` and can turn its heads in its epilogue: the
    tile-streaming one (`"fast"`) or the GEMV by rows (`"rows"`) for a step's one row, else None."""
    if m != 1:
        return None
    if fmt in FAST_GEMV_FORMATS:
        return "fast"
    return "rows" if rows_gemv(fmt, m) else None


# --- a batch step's inputs (`run/paged.py`, `triton/advance.py`) ---------------------------------------------

# A batch step's inputs are one int32 device tensor: these columns, `rows` values each, then the rows' block
# tables (`width` values a row). The step reads them; the device advance (`triton/advance.py`) writes the next
# step's from them and the step's picks, so both read the layout from here.
BATCH_ID, BATCH_POSITION, BATCH_SLOT, BATCH_LENGTH = range(4)
BATCH_COLUMNS = 4

# --- norms -----------------------------------------------------------------------------------------------

# A norm's thread loads eight f32 values of its row: two 16-byte vector loads.
NORM_VALUES_A_THREAD = 8
# The most values of a row one thread keeps in registers between a norm's sum of squares and its scaling. A
# norm folded into a product's last block (GemvNormEpilogue, a mixture's last down block) reads the row back
# once and keeps it: 32 f32 registers a thread leave the block's product registers unspilled.
NORM_HELD_A_THREAD = 32

# --- rotations and attention -----------------------------------------------------------------------------

# A rotation launch of up to ROPE_ONE_HEAD_ROWS rows (a decode step, a batch's step) takes a program a head of
# a row, a pair of values a thread: it waits on its latency (eight heads a program, 16 values a thread, took
# Qwen2.5-0.5B's decode 5 % slower). Past that a program takes a few heads of one side (about
# ROPE_HEAD_VALUES values of a row) and a few rows of them, so a row's angles are computed once for its heads:
# about ROPE_VALUES values a program, ROPE_VALUES_A_THREAD a thread, in at most ROPE_WARPS warps
# (`triton/rope.rope_tile`); a 512-row prompt chunk's rotations take a few hundred programs.
ROPE_ONE_HEAD_ROWS = 64
ROPE_HEAD_VALUES = 512
ROPE_VALUES = 2048
ROPE_VALUES_A_THREAD = 16
ROPE_WARPS = 8
# The largest head a rotation turns: the QKV GEMV's rotation epilogue keeps a head in a program's registers.
ROPE_HEAD = 256
# One launch of rotations takes a layer's query and its key.
ROPE_SIDES = 2

# An attention loads its values a pair at a time (one 32-bit load of two f16, or a 64-bit one of two f32),
# so a value read in place starts at an even place of an even pitch.
ATTN_VALUES_A_LOAD = 2
# Query heads a decode block takes at most: one. A block's warps share its SM's issue slots, so a block of G
# heads runs its tiles about G times slower, and the heads' shared read of the tile does not buy that back
# (H200, `benchmarks/attn_decode_sweep.py`, span 64: 4.2 us a head a block against 22.4 us for 7 of the
# 0.5B's heads; 5.7 against 14.4 for 4 of the 8B's; the other heads' reads of a tile hit L2).
ATTN_HEADS_A_BLOCK_MOST = 1
# Cached rows a decode block reads at a time: each thread holds its share of the tile's keys and values
# (32 rows of 128 values, twice, over a warp: 128 registers as a plain launch, 238 as a dependent one that
# holds its first tile across its wait; no spills, sm_90). 32 rows ran 20-40 % faster
# than 16 at every span measured, and 8 slower again (H200, 2026-11-29: 8B span 576 6.4 us against 8.4).
ATTN_DECODE_TILE_ROWS = 32
# Blocks a decode attention wants a SM (a block is one warp): at a long span, eight a SM read each split's
# tiles with fewer partials to merge than sixteen (H200, in the step at depth 4096: 8B 338 -> 351 tok/s,
# 0.6B 986 -> 1,061; 4, 6 and 32 were slower, 312 / 334 / 332 on the 8B). Short spans are cut by
# ATTN_MIN_CHUNK instead, so they do not change.
ATTN_WAVES = 8
# The fewest cached rows a split of the span takes: a split's partial (one LSE-weighted row a head) and its
# merge stay small against attending this many rows, and a short span runs as one split with no merge. One
# tile: a block reads its first tile before its wait (`triton/attention.py`), so a split of one tile has
# nothing left to read from the cache once the launch before ends (H200, in the step at a 512-640 span:
# 8B 406 -> 413 tok/s, 0.6B 1,277 -> 1,377 against 64 rows). A long span's splits are longer: ATTN_WAVES
# caps their number (33 splits of ~124 rows for the 8B's 32 heads at 4,096 rows).
ATTN_MIN_CHUNK = 32

# The packed decode attention (`triton/attention/group_decode.py`, AttnGqaRowPacking: a key/value group's
# query heads the rows of f16 tensor-core products, under the int8 numerics). Cached rows a tile (keys and
# values, two pipeline stages, copied in while the tile before multiplies), warps a block, and blocks a SM
# its splits aim at: one block a group and split, each cached row read once a step. H200, caches read cold
# (`benchmarks/attn_decode_sweep.py`, 2026-12-03): 64-row tiles in two stages were within noise of the best
# of 64/128 rows x 2/3 stages at spans 1,024 and 4,096 on the 0.5B, 7B, 8B and Qwen3-Next heads.
ATTN_GROUP_TILE_ROWS = 64
ATTN_GROUP_STAGES = 2
# Blocks a SM the splits aim at, and the most splits: at 4,096 rows 32 splits ran 10.4 us on the 8B's heads
# against 12.2 for 16 (0.6B 10.8 against 12.2; 32B 11.6 against 12.0), and 64 no faster on the 7B's or
# Qwen3-Next's (9.2 against 9.1; 14.3 against 13.1): past 32 the merge's partials cost more than the splits
# gain.
ATTN_GROUP_WAVES = 2
ATTN_GROUP_MOST_SPLITS = 32
# The fewest cached rows a packed split takes: one tile (at a 1,024-row span 16 splits of a tile ran 5.3 us
# on the 7B's heads and 6.1 on the 8B's, against 5.8 and 6.5 for 8 splits of two).
ATTN_GROUP_MIN_CHUNK = ATTN_GROUP_TILE_ROWS
# Warps a packed block: four, or eight where its blocks leave SMs without a second block and its merge holds a
# group's heads of GROUP_WIDE_MERGE values or more (at 4,096 rows the 7B's seven heads of 128 in 128 blocks:
# 9.1 us against 9.6; Qwen3-Next's 2 x 8 of 256 in 64 blocks: 13.1 against 14.0). Eight ran slower for the
# 0.5B's 7 x 64 (6.7 against 5.8), and for the 32B's 8 x 5 of 128 in 256 blocks (14.9 against 11.6). In the
# model too: the 7B's tg128 at depth 4,096 381.9 with eight, 377.1 with four (H100, RESULTS.md 2026-12-05, eighth).
ATTN_GROUP_WARPS = 4
ATTN_GROUP_WIDE_WARPS = 8
GROUP_WIDE_MERGE = 1024
# f32 values a thread of a packed block's merge holds at a time (its heads x splits x the head's values over
# the block's threads): where every split's partial fits, the merge loads them all at once. Measured slower
# (H100, 4,096 rows, RESULTS.md 2026-12-05 (sixth)): the partials normalized and kept in f16 (half the merge's
# bytes; 7B 9.7 -> 11.0 us a launch) and a split's later tiles asked of L2 before its wait (7B 9.8 -> 10.2, 8B
# 11.3 -> 13.0); a split's second tile read before the wait with its first (the launch alone 9.8 -> 9.6 us, but
# the 7B's tg128 at depth 4,096 382 -> 368: a block holding both tiles before its wait takes the overlap with
# the GEMV launched before it; RESULTS.md 2026-12-05, eighth).
ATTN_GROUP_MERGE_HELD = 128

# The delta rule's step with its output's gated norm (`norm_in_step`): a program holds a head's whole value
# width (the state's dk x dv in f32) in four warps, as the step's programs of 32 columns do. At the 80B-A3B's
# heads of 128 x 128 (sm_90) that is 225 registers and no stack; the step and the norm's launch took 5.41 /
# 5.47 us a layer against 5.41 / 5.51 for the step norming its output (H200, 12 states replayed in turn;
# eight warps: 174 registers, 5.80 us). Past GDN_NORM_MOST_DV values a thread's share of the state would
# spill, and the norm keeps its own launch.
GDN_NORM_MOST_DV = 128

# The absorbed latent attention's decode program (`triton/mla/attention.py`): a query row's heads share one
# cached latent row, so a program takes MLA_HEADS_A_PROGRAM heads of a row, the whole value width, over
# MLA_TILE_ROWS cached rows at a time, in MLA_WARPS warps. Its scores are summed MLA_SCORE_CHUNK query values
# at a time: Triton's f32 tile product (on the CUDA cores) holds each thread's rows of both operands over the
# whole summed width, so one 576-wide product held a thread's query rows whole and spilled (sm_90, the kernel
# before, one program a row's heads: 128 registers and 1,856 stack bytes a thread at 16 heads, 17,744 at 128).
# Here (sm_90, `benchmarks/mla_registers.py`): 127-148 registers and no stack at 16 and at 128 heads, at any
# shares; a tile is 1,914 instructions a warp, 1,089 of them products (8 heads x 16 rows x 1,088 / 128 threads:
# none made twice). 16 heads in 8 warps take 247 registers (one program a SM where 8 in 4 fit three); 16 in 4
# warps, 2,178 products a tile and 88 stack bytes. Cutting the value width across programs
# (MLA_VALUE_SLICES) makes each slice's tile of scores again: 4 slices for 16 heads, 1,410 products a thread a
# tile for a quarter of the values, so the width stays whole.
MLA_HEADS_A_PROGRAM = 8
MLA_TILE_ROWS = 16
MLA_SCORE_CHUNK = 32
MLA_WARPS = 4
MLA_VALUE_SLICES = 1
# The fewest cached rows a share of the span takes: one tile. A decode step at a short span is a few tiles a
# head block, and its time is one program's chain of tiles, so each share takes one (64 rows: four shares).
# The shares are fixed at the cache's length; a step's shares past its position hold no rows and are skipped.
MLA_MIN_CHUNK = MLA_TILE_ROWS
# A share's partial is its block's weighted latents in f32 (8 heads x 512: 16 KB), merged in two levels
# (`attention.clusters`: the last of each cluster of about sqrt(S) shares combines its cluster's, the last
# cluster the clusters'), each level by one program reading MLA_MERGE_BATCH partials an L2 round trip: a
# partial costs about what a program spends attending MLA_MERGE_ROWS cached rows (a round trip, ~0.3 us, for
# a few partials, against ~1-2 us a tile of 16 rows). A span of n rows in S shares then takes about n / S rows'
# time plus 2 sqrt(S) partials', least at S = (n / MLA_MERGE_ROWS)^(2/3): 161 shares at 4,096 rows.
MLA_MERGE_ROWS = 2
# Partials a merge step reads (their maxima, sums and weighted latents: 4 x 32 values a thread), their loads in
# flight together: a round trip for four. The merging program holds them in 135-148 registers, no stack (sm_90).
MLA_MERGE_BATCH = 4

# The packed latent attention (`triton/mla/packed.py`, under the int8 numerics' f16 attention): a row's heads
# (at most MLA_PACKED_MOST_HEADS, padded to 16) the rows of f16 tensor-core products, MLA_PACKED_TILE_ROWS
# cached rows a tile (the latents and rotated keys, 36 KB in f16 at 576 values) in MLA_PACKED_STAGES stages, the
# value width in MLA_PACKED_VALUE_SLICES slices a program each (a slice's merge reads 16 heads x 128 values a
# split), MLA_PACKED_WARPS warps. The splits are `attn_group_splits`' over a row's slices. Compiled for sm_90
# (H200/H100) at V2-Lite's widths: 191 registers, no stack, 63 KB of shared memory; one slice (the whole 512
# values a program) spills 3 KB, 32 heads 384 bytes, so 16 heads at most (V3's 128 take `attention.py`).
MLA_PACKED_MOST_HEADS = 16
MLA_PACKED_TILE_ROWS = 32
MLA_PACKED_STAGES = 2
MLA_PACKED_VALUE_SLICES = 4
MLA_PACKED_WARPS = 4

# A per-head product (`triton/mla/heads.py`: DeepSeek's value half, which `attn_output` reads in int8) writes
# its int8 form in its programs (GemvQuant) where a program holds whole 32-value blocks of a head's outputs:
# HEAD_QUANT_ROWS outputs a program (the float kernel's are as many), HEAD_QUANT_WARPS warps, four rows a warp.
HEAD_QUANT_ROWS = QBLOCK
HEAD_QUANT_WARPS = 8


def head_product_quantizes(b: int) -> bool:
    """Whether a per-head product of `b` outputs a head writes their int8 form in its programs."""
    return b % HEAD_QUANT_ROWS == 0


# The short-span path (`triton/mla/whole.py`): a row whose live span (read on the device) is at most
# MLA_SHORT_ROWS cached rows runs whole, a program a head and MLA_SHORT_VALUES values of the width (V2-Lite:
# 16 x 4 = 64 programs), MLA_SHORT_TILE_ROWS rows at a time, its scores summed MLA_SHORT_CHUNK query values
# at a time ([32, 128]: 32 a thread of 4 warps, the layout of the loaded rows; the values' slice as wide as the
# chunk, so the weights need no exchange between the two: 168 registers, no stack, sm_90), the next
# MLA_SHORT_STAGES - 1 tiles' rows in flight (cp.async through shared memory, which the split path's tiles
# already take: 121 KB a program either way), no shares and no merge. Every program reads each cached row whole
# (1,152 bytes) for its scores, so the launch reads the span from L2 once a program: 64 programs halve what 128
# (64 values each) read, 74 MB at 1,024 rows against ~6 TB/s of L2. Its time grows with the span (one
# program's chain of tiles) where the split path's is about flat, so it stops where the split path's fixed
# phases (a tile through shared memory, a partial, a count, a merge; 17.9 us measured at depth 64) are paid
# back: 1,024 rows (32 tiles), a guess from the instruction counts and those bytes, to be set by
# `benchmarks/mla_decode_sweep.py`. `bench`'s decode runs after its prompt (512 + 128 rows), so it takes this
# path. Only where a row's programs fit the chip in one wave (`run/mla_launch.short_path`: V2-Lite's 64, not
# V3's 512), one program a SM.
MLA_SHORT_ROWS = 1024
MLA_SHORT_STAGES = 3
MLA_SHORT_VALUES = 128
MLA_SHORT_TILE_ROWS = 32
MLA_SHORT_CHUNK = 128
# A short span past MLA_SHORT_SHARE_ROWS rows (8 tiles) is cut into shares of whole tiles, as many as the chip
# runs at once (`run/mla_launch.short_path`: 2 for V2-Lite's 64 programs on 132 SMs), merged in one read by the
# last share of each head and slice to end: the chain of tiles halves at `bench`'s depth (~600 rows) for a
# partial's store, a count and one L2 round trip (~1-2 us, against ~8 tiles).
MLA_SHORT_SHARE_ROWS = 256

# Cached rows a paged decode program (`triton/attention/paged.py`) reads at a time: the decode tile's rows,
# gathered from as many of the row's pool blocks as they span (two of the engine's 16-row blocks), each row
# found through its block's id. A pool row is one load segment wherever its block lies, so a tile over
# blocks reads as a contiguous tile of the cache does, and a loop step folds several blocks at once.
ATTN_PAGED_TILE_ROWS = ATTN_DECODE_TILE_ROWS

# --- convolutions and mixtures ---------------------------------------------------------------------------

# One launch of convolutions takes at most four: a hybrid layer's q, k, v and gate channels.
CONV_PARTS = 4
# A convolution's epilogue norms each head by a block, a value a thread: at most a block's threads, whole
# warps of them.
CONV_L2_MAX_HEAD = MAX_BLOCK_THREADS


def rows_gemv(fmt: Format, m: int) -> bool:
    """Whether the f32 GEMV by checkpoint rows takes a product of `m` rows (at most the GEMV's) in `fmt`: its
    formats at any rows, the ones it decodes a value at a time (`VALUE_GEMV_FORMATS`) at a step's one row."""
    return fmt in ROWS_GEMV_FORMATS or (m == 1 and fmt in VALUE_GEMV_FORMATS)


def decodes(fmt: Format) -> bool:
    """Whether the GEMV decodes checkpoint rows of `fmt` in its kernel, block by block."""
    return fmt in DECODED_FORMATS


def int8_gemv(fmt: Format, m: int, k: int, batch: bool = False) -> bool:
    """Whether the int8 GEMV takes a product of `m` rows of `k` values in `fmt`: one row, or a batch's rows
    up to the GEMV's (each its own sequence's decode row: `triton/gemv/q8_rows.py`, which reads a chunk of
    weights once for all of them), in one of its formats, whole blocks of the format. A batch's rows past the
    GEMV's multiply as a chunk's do, on the tensor cores."""
    rows = m == 1 or (batch and m <= GEMV_ROWS)
    return rows and fmt in INT8_GEMV_FORMATS and k % (QK_K if fmt in SUPER_BLOCK_FORMATS else QK) == 0


def norm_walked_in_chunks(fmt: Format, m: int, k: int, n: int, int8: bool) -> bool:
    """Whether a projection's add + norm epilogue walks the norm's `n`-wide row in chunks (any width): a step's
    one row in the f32 GEMVs' formats (the fast GEMV's and the GEMV by rows', past the row its block holds), or
    in the int8 GEMV's (`int8`: its activation is read as int8) where the norm's row is whole 32-value blocks
    (it writes their int8 form too)."""
    if m != 1:
        return False
    f32 = fmt in FAST_GEMV_FORMATS or rows_gemv(fmt, m)
    return f32 or (int8 and int8_gemv(fmt, m, k) and n % QBLOCK == 0)


def rows_a_warp(fmt: Format, n: int, k: int, m: int) -> int:
    """Output rows a warp of a product's kernel takes: four for a wide product in a block format met one row
    at a time, one otherwise."""
    wide = n >= WIDE_N and k >= WIDE_K
    return ROWS_A_WARP_WIDE if decodes(fmt) and m == 1 and wide else 1


def pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def norm_threads(cols: int) -> int:
    """The threads of a norm's block for a row of `cols` values: eight values a thread, whole warps, a power
    of two, at most a block's."""
    wanted = pow2_at_least(math.ceil(cols / NORM_VALUES_A_THREAD))
    return min(MAX_BLOCK_THREADS, max(WARP, wanted))


def gemv_blk_norm_threads(per_warp: int) -> int:
    """The threads of a decoded GEMV's block, which its last block norms the row with: a block format's is
    eight warps or four."""
    warps = GEMV_BLOCK_WARPS_FOUR_ROWS if per_warp == ROWS_A_WARP_WIDE else GEMV_BLOCK_WARPS_ONE_ROW
    return warps * WARP


def block_holds_its_norm(threads: int, cols: int) -> bool:
    """Whether a block of `threads` holds a `cols`-wide row in registers to norm it."""
    return cols <= threads * NORM_HELD_A_THREAD


# --- arithmetic ------------------------------------------------------------------------------------------


class Mode(enum.Enum):
    """How a product multiplies, by the lane's activations."""

    FLOAT = "f32"  # decoded weights times f32 activations, f32 sums
    INT8 = "int8"  # int8 dot products (dp4a, int8 mma), int32 sums
    INT8X2 = "int8x2"  # two int8 passes, each summed in int32


class Accumulator(NamedTuple):
    """A product's running sum: the bytes it takes in registers or shared memory, and its width in bits."""

    nbytes: int
    bits: int


ACCUMULATOR_BITS = 32  # f32 or int32: the widest sum a tensor core or a dp4a keeps
ACCUMULATOR_BYTES = ACCUMULATOR_BITS // 8


def mode(activations: Activations) -> Mode:
    """The arithmetic of the lane's products under `activations`."""
    return {Activations.DEQUANT: Mode.FLOAT, Activations.INT8: Mode.INT8, Activations.INT8X2: Mode.INT8X2}[activations]


def accumulator(m: Mode) -> Accumulator:
    """The accumulator of a product in mode `m`: f32 for floats, int32 for int8 words; both 32 bits."""
    return Accumulator(ACCUMULATOR_BYTES, ACCUMULATOR_BITS)


def attn_heads_a_block(group: int, hd: int = 0) -> int:
    """Query heads of one key/value group a decode attention block takes: the most, up to
    `ATTN_HEADS_A_BLOCK_MOST`, that divide the group (a warp a head; the tile is read once for them all). Heads of
    `hd` values that are not whole 32-value blocks (48, 80) take the fewest more that divide the group and are
    whole blocks together (two heads of 80: five), so the block writes its output's int8 form alone; the most
    where none are (an odd group: its blocks share their seams, `attention.splits.seam_counters`).

    Measured (H200, `benchmarks/attn_decode_sweep.py --seams`, 32 query heads over 8, µs a launch at spans 64 /
    1,024 / 4,096): heads of 80, a head a block with seams 6.5 / 10.1 / 39.7, two heads a block 5.9 / 10.0 /
    26.7; heads of 48, 5.3 / 7.0 / 13.6 against 5.5 / 7.4 / 13.9. The seams cost nothing measurable (a head a
    block then a `Quantize` launch: 6.0 / 10.1 / 39.6 and 5.4 / 7.0 / 13.9)."""
    most = max(h for h in range(1, min(group, ATTN_HEADS_A_BLOCK_MOST) + 1) if group % h == 0)
    if not hd or attn_block_whole_blocks(hd, most):
        return most
    return next((h for h in range(most, group + 1) if group % h == 0 and attn_block_whole_blocks(hd, h)), most)


def attn_block_whole_blocks(hd: int, heads_per_block: int) -> bool:
    """Whether a decode attention block's output is whole 32-value blocks of the row, so the block writes its
    int8 form alone: heads of whole blocks, or a block's heads together (two heads of 80 values: five blocks).
    Otherwise neighbouring blocks share a 32-value block (a seam), and the last of them to store quantizes it
    (`attention.splits.seam_counters`)."""
    return hd % QBLOCK == 0 or heads_per_block * hd % QBLOCK == 0


def attn_splits(head_blocks: int, span: int, sms: int, min_chunk: int = ATTN_MIN_CHUNK) -> int:
    """Chunks an attention cuts its span into: enough that its blocks fill the chip `ATTN_WAVES` times over,
    no chunk under `min_chunk` rows."""
    wanted = math.ceil(ATTN_WAVES * sms / max(1, head_blocks))
    most = math.ceil(max(1, span) / min_chunk)
    return max(1, min(wanted, most))


def attn_group_splits(kv_heads: int, span: int, sms: int, min_chunk: int = ATTN_GROUP_MIN_CHUNK) -> int:
    """Chunks the packed decode attention cuts its span into: a power of two (the merge's tile of splits has no
    padding), as many as keep its groups' blocks within `ATTN_GROUP_WAVES` a SM, at most
    `ATTN_GROUP_MOST_SPLITS`, no chunk under `min_chunk` rows."""
    wanted = max(1, ATTN_GROUP_WAVES * sms // max(1, kv_heads))
    most = math.ceil(max(1, span) / min_chunk)
    return 1 << (min(wanted, most, ATTN_GROUP_MOST_SPLITS).bit_length() - 1)


def attn_group_warps(group: int, hd: int, blocks: int, sms: int) -> int:
    """Warps a packed decode block takes: more where `blocks` leave SMs without a second one and its merge holds
    a wide group (`GROUP_WIDE_MERGE`)."""
    wide = (1 << (group - 1).bit_length()) * hd >= GROUP_WIDE_MERGE
    return ATTN_GROUP_WIDE_WARPS if wide and blocks <= sms else ATTN_GROUP_WARPS


def mla_splits(head_blocks: int, span: int, sms: int) -> int:
    """Shares the latent attention cuts a span of `span` cached rows into for `head_blocks` programs a share:
    `attn_splits`' (the chip filled, a tile a share at least), no more than the merge's balance
    (`MLA_MERGE_ROWS`) allows."""
    balance = max(1, round((max(1, span) / MLA_MERGE_ROWS) ** (2 / 3)))
    return min(attn_splits(head_blocks, span, sms, MLA_MIN_CHUNK), balance)


# --- a projection's add + norm ---------------------------------------------------------------------------------

# How many times longer than the norm is wide a product's rows must be for its add + norm to take a launch of
# its own (`norm_in_own_launch`): a Qwen down projection's rows are 2.7-5.4 times the hidden width, an
# attention output projection's at most twice (Qwen3-0.6B's 16 heads of 128 over 1024), so only the down
# projection's norm leaves its epilogue and a layer takes one launch more. The plan asks only of a gated pair's
# down projection (`fits._gemv_norm_epilogue`): a query more than twice the hidden width keeps the attention
# output's norm in its epilogue, or the layer would take 8 launches.
NORM_OWN_LAUNCH_RATIO = 2


def norm_in_own_launch(m: Mode, k: int, n: int) -> bool:
    """Whether a decode GEMV's residual add and norm run in a launch of their own (the product, then AddNorm)
    instead of in the GEMV's last program (GemvNormEpilogue): under int8 activations, where the product's
    rows are more than NORM_OWN_LAUNCH_RATIO times as long as the norm is wide (a down projection).

    Why: under dependent launches the epilogue's tail is serial (every program releases its rows at gpu scope,
    then one program reads the row back, norms and quantizes it), and it cost more than a launch of its own
    on the H200: 8B down (4096 x 12288 Q4_K) 18.0 -> 13.9 us, 7B down (3584 x 18944 Q6_K) 37.9 -> 30.9 us;
    an o_proj gains less (4096 x 4096: 9.0 -> 7.1 us) and stays in its epilogue. The dequantized GEMVs were
    not measured this way and keep theirs. The lane asks only under its `norm_launch` knob (on by default;
    `rope_epilogue=auto` keeps a layer whose V product takes a launch of its own within 7 launches).
    """
    return m is Mode.INT8 and k > NORM_OWN_LAUNCH_RATIO * n

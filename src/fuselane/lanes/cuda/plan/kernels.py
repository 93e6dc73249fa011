"""The cuda lane's kernel facts: the one place that says what shapes each Triton kernel takes (a mixture's
kernels' in `moe_kernels`, the rotations' and attentions' in `attn_kernels`, which build on these).

The kernels size their launches from these values and the shim decides from the same values whether a fused
op has a launch, so a fusion the optimizer builds is always one a kernel runs. Each value is chosen for an
H200 (Hopper, sm_90: warps of 32 lanes, at most 1024 threads a block, 227 KiB of shared memory a block) and
says why beside it. Chip-specific quantities (SM count, shared memory) come from the knobs' `Chip`, never
from here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import NamedTuple

from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, QK, QK_K, Format
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
# MXFP4's 17-byte blocks (an e8m0 exponent e, then IQ4_NL's 16 bytes of codes in its nibble order) are split as
# IQ4_NL's, their 1-byte e after the row (the kernels make its scale 2^(e - 128), ggml's e8m0 halved for the
# doubled table, exactly, from the byte): so MXFP4 runs every IQ4_NL path with its own table
# (`formats.MXFP4_VALUES`) and its scale from e, in the file's bytes (a 2-byte d would be 6 % more).
STORED_BLOCK_BYTES = {
    Format.Q3_K: 112, Format.Q6_K: 208, Format.Q8_0: 32, Format.Q4_0: 16, Format.IQ4_NL: 16, Format.IQ4_XS: 128,
    Format.MXFP4: 16,
}  # fmt: skip
# Formats whose blocks' f16 scale d (and the fields after it up to these bytes: IQ4_XS's scales; MXFP4's e) is
# kept after a row's blocks (bytes a block), not in each block
ROW_TAIL_D = {Format.Q6_K: 2, Format.Q8_0: 2, Format.Q4_0: 2, Format.IQ4_NL: 2, Format.IQ4_XS: 8, Format.MXFP4: 1}
# ...the file's field those bytes start at, where it is not d
TAIL_FIELD = {Format.MXFP4: "e"}
# A row of a ROW_TAIL_D format ends on this many bytes, so the next row's runs start aligned for its loads
ROW_ALIGN_BYTES = {
    Format.Q6_K: 16, Format.Q8_0: 8, Format.Q4_0: 8, Format.IQ4_NL: 8, Format.IQ4_XS: 16, Format.MXFP4: 8,
}  # fmt: skip


def stored_block_bytes(fmt: Format) -> int:
    """Bytes from one block of `fmt` to the next on the device (`STORED_BLOCK_BYTES`, else the file's)."""
    return STORED_BLOCK_BYTES.get(Format(fmt), LAYOUTS[Format(fmt)].nbytes)


def stored_offset(fmt: Format, field: str) -> int:
    """The byte offset of `field` in a block of `fmt` as the device keeps it: the file's, less the d's bytes where a
    `ROW_TAIL_D` format's d, kept after the row, came before it (Q8_0's codes start a stored block)."""
    lay = LAYOUTS[Format(fmt)]
    at = lay.field(field).offset
    if Format(fmt) not in ROW_TAIL_D:
        return at
    if kept_after_row(fmt, field):
        raise ValueError(f"{Format(fmt).name}'s {field} is kept after its row's blocks, not in a block")
    return at - ROW_TAIL_D[Format(fmt)] if tail_offset(fmt) < at else at


def tail_field(fmt: Format) -> str:
    """The file's field a `ROW_TAIL_D` format's bytes kept after the row start at: d, or MXFP4's e."""
    return TAIL_FIELD.get(Format(fmt), "d")


def tail_offset(fmt: Format) -> int:
    """That field's offset in the file's block."""
    return LAYOUTS[Format(fmt)].field(tail_field(fmt)).offset


def kept_after_row(fmt: Format, field: str) -> bool:
    """Whether `field` of a block of `fmt` is kept after its row's blocks on the device (a `ROW_TAIL_D` format's
    d, and IQ4_XS's scales with it), not in the block."""
    if Format(fmt) not in ROW_TAIL_D:
        return False
    d_at = tail_offset(fmt)
    return d_at <= LAYOUTS[Format(fmt)].field(field).offset < d_at + ROW_TAIL_D[Format(fmt)]


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
    Format.Q5_1: 4, Format.IQ4_NL: 4, Format.IQ4_XS: 4, Format.Q3_K: 2, Format.Q2_K: 2, Format.MXFP4: 4,
}  # fmt: skip
INT8_GEMV_FORMATS = frozenset(INT8_GEMV_TILE_ROWS)
# Formats one int8 GEMV launch in parts takes (a decode step's one row): each program's part is one format, so
# the kernel holds a body for each; the first part's format sets the launch's tile.
GEMV_PARTS_FORMATS = 2
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
VALUE_GEMV_FORMATS = frozenset({Format.Q2_K, Format.Q3_K, Format.IQ4_NL, Format.IQ4_XS, Format.MXFP4})
# The formats the whole-matrix decode on the device (`gemv/epilogue.dequantize`) takes: the prefill products'
# f16 copies and scratch come from it, so a checkpoint in any of them prefills on cuBLAS.
DEQUANT_FORMATS = ROWS_GEMV_FORMATS | VALUE_GEMV_FORMATS
# The grid and ternary formats (`formats.GRID_FORMATS`), decoded from their grids' tables (`triton/grid/`): by
# their own GEMV for a product's rows within the GEMV's (with a bias, a landing row, a step's add + norm, or
# as a gated pair), whole for a chunk's scratch or f16 copies (`gemv/epilogue.dequantize` hands them on). No
# other kernel decodes one (`fits._grid_launch`): not a launch in parts, a gather, a per-head or an expert
# product.
GRID_GEMV_FORMATS = GRID_FORMATS
# The grid formats whose GEMV reads a step's one row in int8 (`triton/grid/q8.py`: grid bytes against the codes
# in dp4a) under int8 activations, so the plan quantizes that row for them as for the int8 GEMV's formats: every
# one with a grid; the ternary formats (TQ1_0, TQ2_0; no grid) read f32.
GRID_INT8_FORMATS = GRID_GEMV_FORMATS - {Format.TQ1_0, Format.TQ2_0}
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
# The grid GEMV's tiles (`triton/grid/gemv.py`, `grid_tile`) take rows dividing this: a head of a multiple of it is
# whole programs, so the GEMV in parts turns a query's and a key's heads in its epilogue
# (`triton/grid/parts_rope.py`)
GRID_GEMV_MOST_TILE_ROWS = 16


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

# --- convolutions and mixtures ---------------------------------------------------------------------------

# The delta rule's step with its output's gated norm (`norm_in_step`): a program holds a head's whole value
# width (the state's dk x dv in f32) in four warps, as the step's programs of 32 columns do. At the 80B-A3B's
# heads of 128 x 128 (sm_90) that is 225 registers and no stack; the step and the norm's launch took 5.41 /
# 5.47 us a layer against 5.41 / 5.51 for the step norming its output (H200, 12 states replayed in turn;
# eight warps: 174 registers, 5.80 us). Past GDN_NORM_MOST_DV values a thread's share of the state would
# spill, and the norm keeps its own launch.
GDN_NORM_MOST_DV = 128

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


def grid_int8(fmt: Format, m: int, batch: bool = False) -> bool:
    """Whether the grid GEMV reads a product's activation in int8: a step's one row (not a batch's rows) in
    one of GRID_INT8_FORMATS (whole super-blocks: every grid matrix's rows are)."""
    return m == 1 and not batch and fmt in GRID_INT8_FORMATS


def dependent_launch_pays(formats: Iterable[Format]) -> bool:
    """Whether a model's steps run faster with each launch a dependent of the one before (`triton/pdl.py`),
    given the formats of the matrices its dense products multiply: not where one is a grid format, which the
    grid GEMV multiplies. Measured (H100, the 7B, `fuselane bench -p 512 -n 128`, benchmarks/RESULTS.md): in
    IQ3_M, whose gated pairs and downs run the grid GEMV, 119.1 tok/s with them against 149.7 without; in
    Q4_K_M, 443.3 against 414.1. A mixture's grid experts run kernels of their own (`grid/experts.py`),
    unmeasured either way, so they keep the lane's default."""
    return not any(fmt in GRID_GEMV_FORMATS for fmt in formats)


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

"""The cuda lane's kernel facts of rotations and attention: what shapes the rotation, the decode and prefill
attention and the latent attention kernels take, and how a span is cut into splits.

Part of the one place that says what shapes each Triton kernel takes (`kernels` holds the rest, `moe_kernels`
the mixture's): the kernels size their launches from these values and the shim decides from them whether a
fused op has a launch. Chip-specific quantities (SM count) come in as arguments, never from here.
"""

from __future__ import annotations

import math

from fuselane.lanes.cuda.plan.kernels import QBLOCK

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

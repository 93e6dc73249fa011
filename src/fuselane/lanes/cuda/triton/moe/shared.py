"""A decode step's folded shared expert (SharedExpertFusion): its gate/up SwiGLU and its gate's sigmoid ride the
kept experts' gate/up launch as programs of their own (`gate_up.gate_up`), into a scratch row; the down launch
(`down.down_combine`) then adds sigmoid * (its down rows . that row) in each of its programs. An ungated shared
expert (DeepSeek's) has no score: its gate/up launch writes 1 where the sigmoid would go. The SwiGLU is
f32 products (`shared_phase`), or, under `moe_kernels.MOE_SHARED_INT8` where the expert's gate/up are the kept
experts' format, their own int8 tiles (`gate_up`, `Shared.tiles`); the score is always an f32 product. Where the
SwiGLU runs as int8 tiles, the down rows are an int8 product of its int8 form, which the tiles write a block each
(`scratch_q8`), in every format the int8 GEMV takes (`Shared.down_int8`); otherwise an f32 product, in the
formats the f32 GEMV by rows decodes at speed. Under activations=dequant (`f32`: the kept experts read f32)
every product is f32, Q2_K, Q3_K, IQ4_NL and IQ4_XS decoded a value at a time.

Why the int8 down: an f32 product re-reads the whole f32 SwiGLU row in every down program, beside that program's
few rows of weights, and decodes them a value at a time in f32 (H100, replayed decode step at depth 64, Q4_K_M:
DeepSeek-V2-Lite 2.579 ms with an f32 down of its two shared experts, 2.146 with the int8 one; Qwen1.5-MoE-A2.7B
2.324 against 1.813; benchmarks/RESULTS.md, 2026-12-05).

Why there: the shared expert reads the mixture's input, as the kept experts' gate/up does, so its products run
beside theirs with nothing to wait for, and the down launch reads the row as it reads the kept experts'
activations, after its wait for the launch before. Computed at the start of the down launch instead, the down
programs waited for the shared programs (H200, Qwen3-Next-80B-A3B's widths: the down launch 50 µs against 12
without the expert, 14 µs more even at 32 shared values).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.plan import kernels, moe_kernels
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
from fuselane.lanes.cuda.triton.gemv import rows as gemv_rows
from fuselane.lanes.cuda.triton.moe.common import f32_plan, row_dot, tiles
from fuselane.lanes.cuda.triton.quant import Q8Acts


@dataclass(frozen=True, slots=True)
class Shared:
    """A folded shared expert: x f32 (1, d), its gate/up (sdff, d), down (d, sdff) and gate score (1, d; None
    where it is ungated) checkpoint rows with their formats, and a scratch row of sdff + 1 f32 (its SwiGLU, then
    its sigmoid, or 1 where ungated)."""

    x: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    score: Tensor | None
    fmt: Format  # the gate's and the up's
    down_fmt: Format
    score_fmt: Format | None
    sdff: int
    scratch: Tensor
    # the SwiGLU row's int8 form, where the down rows are in a format only the int8 GEMV decodes (`down_int8`):
    # the gate/up launch's int8 tiles write it a block each, the down launch's int8 product reads it
    scratch_q8: Q8Acts | None = None
    f32: bool = False  # the kept experts read f32 activations (activations=dequant): every product an f32 one
    tiles: bool = False  # its SwiGLU runs as the kept experts' int8 tiles (`swiglu_tiles`)

    def __post_init__(self) -> None:
        if self.down_int8 and self.scratch_q8 is None:
            raise ValueError(f"a folded shared expert's {Format(self.down_fmt).name} down reads a scratch_q8")

    @property
    def scored(self) -> bool:
        """Whether a sigmoid of its gate's product scales the expert (Qwen2-MoE's; DeepSeek's is ungated)."""
        return self.score is not None

    @property
    def down_int8(self) -> bool:
        """Whether the down rows are an int8 product (`int8_down`)."""
        return int8_down(self.down_fmt, self.sdff, self.f32, self.tiles)


def int8_down(fmt: Format, sdff: int, f32: bool = False, tiles: bool = False) -> bool:
    """Whether a folded shared expert's down rows in `fmt` (rows of `sdff` values) are an int8 product: wherever
    its SwiGLU runs as int8 tiles (`tiles`, which write its int8 form) and the int8 GEMV takes the rows, and in
    a format the f32 GEMV by rows does not decode at its speed (`kernels.ROWS_GEMV_FORMATS`); never where the
    kept experts read f32 (`f32`: activations=dequant), whose numerics have no int8 product
    (`kernels.rows_gemv`)."""
    if f32:
        return not kernels.rows_gemv(fmt, 1)
    return (tiles and gemv_q8.supports(fmt, 1, sdff)) or fmt not in kernels.ROWS_GEMV_FORMATS


def int8_takes(fmt: Format, n: int, k: int) -> bool:
    """Whether the int8 kernel takes experts of (n, k) rows in `fmt` (and writes its int8 form: whole blocks)."""
    return gemv_q8.supports(fmt, 1, k) and n % QK == 0


def swiglu_tiles(kept_fmt: Format | None, fmt: Format, sdff: int, d: int, gate: Tensor, up: Tensor) -> bool:
    """Whether a folded shared expert's SwiGLU runs as the kept experts' int8 tiles (`moe_kernels.MOE_SHARED_INT8`):
    the kept experts read the int8 form of the input (their format `kept_fmt`, None where they read f32), the
    expert's gate and up are that format, whole blocks, and start where the int8 loads need them to."""
    if not moe_kernels.MOE_SHARED_INT8 or kept_fmt is None or Format(fmt) is not Format(kept_fmt):
        return False
    align = gemv_q8.ALIGN.get(Format(fmt), 1)
    return int8_takes(fmt, sdff, d) and not (gate.data_ptr() % align or up.data_ptr() % align)


@triton.jit
def shared_phase(x, w_sg, w_su, w_sc, sh, ticket, SDFF: tl.constexpr, NA: tl.constexpr, SCORED: tl.constexpr,
                 SG_FMT: tl.constexpr, SG_STEPS: tl.constexpr, SG_UNITS: tl.constexpr, SG_SPLIT: tl.constexpr,
                 SG_BLOCK_N: tl.constexpr, SG_STAGES: tl.constexpr, SG_ROW_BYTES: tl.constexpr,
                 SC_FMT: tl.constexpr, SC_STEPS: tl.constexpr, SC_UNITS: tl.constexpr, SC_SPLIT: tl.constexpr,
                 SC_STAGES: tl.constexpr):  # fmt: skip
    """A shared-expert program: tile `ticket` of its SwiGLU, or (the last ticket, SCORED) the sigmoid of its
    score."""
    lane = tl.arange(0, SG_BLOCK_N)
    rows = ticket * SG_BLOCK_N + lane
    if SCORED and ticket == NA - 1:  # the score's one row, every thread a share of it
        one = tl.arange(0, 1)
        y = row_dot(w_sc + one * 0, x, SC_FMT, SC_STEPS, SC_UNITS, SC_SPLIT, 1, SC_STAGES)
        tl.store(sh + SDFF + one, 1.0 / (1.0 + tl.exp(-y)))
    else:
        off = tl.minimum(rows, SDFF - 1).to(tl.int64) * SG_ROW_BYTES
        g = row_dot(w_sg + off, x, SG_FMT, SG_STEPS, SG_UNITS, SG_SPLIT, SG_BLOCK_N, SG_STAGES)
        u = row_dot(w_su + off, x, SG_FMT, SG_STEPS, SG_UNITS, SG_SPLIT, SG_BLOCK_N, SG_STAGES)
        tl.store(sh + rows, g / (1.0 + tl.exp(-g)) * u, mask=rows < SDFF)


def _phase(gate_fmt: Format, score_fmt: Format, d: int, rows: int, warps: int) -> dict:
    """`row_dot`'s constants (`common.f32_plan`) for the SwiGLU's f32 products in tiles of `rows` (SG_, with
    SG_BLOCK_N) and for the score's one row, a tile of its own (SC_): all the program's threads take a share of
    that row's values. As a tile of `rows` lanes each computing the whole row, it walked the row in 8 dependent
    steps at the 80B-A3B's widths, and the launch took 17.7 µs against 8.4 without the expert (H200); the
    one-row tile is not yet timed."""
    sg, _ = f32_plan(gate_fmt, rows, d, "SG_", tile=(rows, warps))
    sc, _ = f32_plan(score_fmt, 1, d, "SC_", tile=(1, warps))
    return sg | {k: v for k, v in sc.items() if k not in ("SC_BLOCK_N", "SC_ROW_BYTES")}


def phase_consts(s: Shared | None, d: int, warps: int, q8_rows: int | None = None) -> tuple[dict, int]:
    """The gate/up launch's shared-expert constants (stand-ins where there is none, so the kernel compiles the
    same) and its programs: the SwiGLU's tiles, then the score's one where the expert is gated (SCORED).
    `q8_rows`: the SwiGLU's tiles are the kept experts' int8 tiles of that many rows (`gate_up`, SHARED_Q8),
    its f32 constants unused."""
    if s is None:
        return _phase(Format.F32, Format.F32, QK, 1, warps) | dict(SDFF=1, SCORED=False), 0
    score_fmt = Format.F32 if s.score_fmt is None else s.score_fmt  # an ungated expert's: a stand-in
    _check_f32_reads(score_fmt, "score")
    if q8_rows is None:
        _check_f32_reads(s.fmt, "gate and up")
    rows = q8_rows if q8_rows is not None else gemv_rows.tile(s.fmt, s.sdff, d, 1)[0]
    # under the int8 tiles the f32 SwiGLU is compiled, never run: its constants stand in for f32 rows (the
    # expert's own format may be one the GEMV by rows does not decode)
    gate_fmt = s.fmt if q8_rows is None else Format.F32
    consts = _phase(gate_fmt, score_fmt, d, rows, warps) | dict(SDFF=s.sdff, SCORED=s.scored)
    return consts, tiles(s.sdff, rows) + s.scored


def _check_f32_reads(fmt: Format, what: str) -> None:
    if fmt not in gemv_rows.SLOTS:
        raise ValueError(f"a folded shared expert's {what} rows are f32 products: not in {Format(fmt).name}")


def down_consts(s: Shared | None, d: int, block_n: int, warps: int) -> dict:
    """The down launch's constants for the shared expert's down rows (stand-ins where there is none): an f32
    product's (SD_, `row_dot`), or, where `s.down_int8`, an int8 product's at the launch's tile (SD_Q8:
    `q8.row_dots` over the SwiGLU's int8 form, its f32 constants stand-ins)."""
    int8 = s is not None and s.down_int8
    fmt, k = (Format.F32, QK) if s is None or int8 else (s.down_fmt, s.sdff)
    _check_f32_reads(fmt, "down")
    consts, _ = f32_plan(fmt, d, k, "SD_", tile=(block_n, warps))
    consts = {k: v for k, v in consts.items() if k != "SD_BLOCK_N"} | dict(SDFF=s.sdff if s else 1)
    q8 = dict(SD_Q8=int8, SD_FMT_Q8=int(Format.Q8_0), SD_N_UNITS=1, SD_CHUNK=1, SD_FENCE=0, SD_DEPTH=1)
    if s is not None and int8:
        plan = gemv_q8.tile_plan(s.down_fmt, s.sdff, block_n, warps, None)
        consts["SD_ROW_BYTES"] = plan["ROW_BYTES"]
        q8 |= dict(SD_FMT_Q8=plan["FMT"], SD_N_UNITS=plan["N_UNITS"], SD_CHUNK=plan["CHUNK"],
                   SD_FENCE=plan["FENCE"], SD_DEPTH=plan["DEPTH"])  # fmt: skip
    return consts | q8

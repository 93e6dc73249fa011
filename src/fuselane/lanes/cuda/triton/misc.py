"""Small device kernels: SwiGLU's activation product (GluActMul, and its int8 form where a product on the int8
tensor cores reads it: GluActMulQuant), the sum of two tensors (a mixture's output and its ungated shared
expert's: a dependent launch, where torch's add would end the chain of dependent launches on both sides of
it), and the greedy sampler's arg-max.

GluActMul is silu(gate) * up, elementwise over rows that may be parts of a wider tensor (a merged gate/up
product's halves are read in place at their row pitch). silu is computed as g / (1 + e^-g), the cpu lane's
form: for g << 0, e^-g overflows to inf and the quotient is the right -0.

The arg-max keeps the sampler's token on the device (a decode step's graph ends with it; the host reads
four bytes). A row as wide as a vocabulary (152k values for Qwen) is cut into chunks, a block a chunk, so
the read spreads over the chip instead of streaming through one SM; each block writes its chunk's best
(value, index) to scratch and the last block of a row to finish (an atomic counter a row, re-armed by that
block) picks the row's best. Ties go to the lowest index, as numpy's argmax breaks them: within a tile by
taking the smallest index among the lanes holding the maximum, across tiles and chunks by replacing the best
only on a strictly greater value. NaN values are not treated specially (numpy would return the first NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton import pdl, quant

# An elementwise block: eight f32 values a thread (two 16-byte loads of each operand), four warps.
GLU_VALUES_A_THREAD = 8
GLU_WARPS = 4
GLU_BLOCK = GLU_VALUES_A_THREAD * GLU_WARPS * kernels.WARP

# An arg-max block reads a chunk of 4096 values in one tile: sixteen values a thread (four 16-byte loads in
# flight each) over eight warps; a 152k-value row is 38 blocks, a few per SM's worth of the chip's 132.
ARGMAX_WARPS = 8
ARGMAX_VALUES_A_THREAD = 16
ARGMAX_CHUNK = ARGMAX_WARPS * kernels.WARP * ARGMAX_VALUES_A_THREAD
# An index past any row: the minimum over lanes not holding the maximum ignores it.
NO_INDEX: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _glu_kernel(
    gate_ptr, up_ptr, out_ptr, gate_pitch, up_pitch, out_pitch, cols, oq, od, os_,
    BLOCK: tl.constexpr, Q8OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    i = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    mask = offs < cols
    g = tl.load(gate_ptr + i * gate_pitch + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i * up_pitch + offs, mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    v = silu * u
    tl.store(out_ptr + i * out_pitch + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
    if Q8OUT:  # the row's int8 form too (whole 32-value blocks: the values past cols are zeros, dropped)
        blocks = cols // quant.QB_C
        quant.store_quantized(v, first, cols, oq + i * cols, od + i * blocks, os_ + i * 2 * blocks)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, a + b, mask=mask)


def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a + b over contiguous f32 tensors of as many values (one f32 rounding each, as torch's add)."""
    tensors = (a, b, out)
    if any(not t.is_contiguous() or t.dtype != torch.float32 or t.numel() != a.numel() for t in tensors):
        raise ValueError("add: contiguous f32 tensors of as many values")
    n = a.numel()
    _add_kernel[(triton.cdiv(n, GLU_BLOCK),)](a, b, out, n, BLOCK=GLU_BLOCK, num_warps=GLU_WARPS, **pdl.options())


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    t2 = t if t.dim() == 2 else t.view(1, -1)
    if t2.stride(-1) != 1:
        raise ValueError(f"{name}: values must be unit-stride")
    return t2


def glu_act_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, out_q8: quant.Q8Acts | None = None) -> None:
    """GluActMul: out = silu(gate) * up, elementwise, in f32. `gate`, `up`, `out` (rows, cols) at any row pitch
    (1-D for one row). With `out_q8` (GluActMulQuant: rows of whole 32-value blocks) the launch also writes
    `out` quantized, as `quant.quantize` would."""
    g2, u2, o2 = _rows(gate, "gate"), _rows(up, "up"), _rows(out, "out")
    rows, cols = g2.shape
    if u2.shape != g2.shape or o2.shape != g2.shape:
        raise ValueError(f"glu_act_mul: gate {tuple(g2.shape)}, up {tuple(u2.shape)}, out {tuple(o2.shape)} differ")
    if out_q8 is not None:
        quant.check_acts(out_q8, cols, rows)
    q = out_q8 if out_q8 is not None else (o2, o2, o2)
    _glu_kernel[(rows, triton.cdiv(cols, GLU_BLOCK))](
        g2, u2, o2, g2.stride(0), u2.stride(0), o2.stride(0), cols, *q,
        BLOCK=GLU_BLOCK, Q8OUT=out_q8 is not None, num_warps=GLU_WARPS, **pdl.options(),
    )  # fmt: skip


@triton.jit
def best_of(x, idx):
    """The tile's largest value and the lowest index holding it."""
    top = tl.max(x, axis=0)
    return top, tl.min(tl.where(x == top, idx, NO_INDEX), axis=0)


@triton.jit
def _argmax_kernel(
    x_ptr,
    out_ptr,
    val_ptr,
    idx_ptr,
    count_ptr,
    x_pitch,
    cols,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * x_pitch
    offs = tl.arange(0, CHUNK)
    # a chunk of one tile when split; every tile of the row in turn when not (split is then 0)
    idx = split * CHUNK + offs
    best, best_i = best_of(tl.load(x_row + idx, mask=idx < cols, other=float("-inf")).to(tl.float32), idx)
    for t in range(1, TILES):
        idx = (split + t) * CHUNK + offs
        top, top_i = best_of(tl.load(x_row + idx, mask=idx < cols, other=float("-inf")).to(tl.float32), idx)
        better = top > best  # strictly: an equal value later in the row keeps the earlier index
        best_i = tl.where(better, top_i, best_i)
        best = tl.where(better, top, best)
    if SPLITS == 1:
        tl.store(out_ptr + row, best_i.to(out_ptr.dtype.element_ty))
    else:
        part = row * SPLITS + split
        tl.store(val_ptr + part, best)
        tl.store(idx_ptr + part, best_i)
        # stored before the release, as in flash_decode's merge: the block's barrier, then an acq_rel atomic
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            s = tl.arange(0, SPLITS_P2)
            smask = s < SPLITS
            vals = tl.load(val_ptr + row * SPLITS + s, mask=smask, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(idx_ptr + row * SPLITS + s, mask=smask, other=NO_INDEX, cache_modifier=".cg")
            # the chunks' indices grow with the chunk: the smallest index holding the best value is the first
            pick = tl.min(tl.where(vals == tl.max(vals, axis=0), idxs, NO_INDEX), axis=0)
            tl.store(out_ptr + row, pick.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


def argmax_splits(cols: int) -> int:
    """Chunks an arg-max cuts a `cols`-wide row into: a block each."""
    return triton.cdiv(cols, ARGMAX_CHUNK)


def argmax_scratch_size(rows: int, cols: int) -> int:
    """f32 values of an arg-max's scratch: a best value and its index a chunk of each row, a counter a row."""
    return rows * (2 * argmax_splits(cols) + 1)


def argmax_scratch(rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """An arg-max's scratch, allocated once (its counters start at zero; the kernel leaves them at zero)."""
    return torch.zeros(argmax_scratch_size(rows, cols), dtype=torch.float32, device=device)


def argmax(logits: torch.Tensor, out: torch.Tensor, *, scratch: torch.Tensor | None = None) -> None:
    """out[i] = the index of the largest value of row i of `logits` (rows, cols) (1-D for one row), the lowest
    index on a tie; `out` int32 or int64 (rows,).

    With `scratch` (`argmax_scratch(rows, cols)`) the row is read by a block a chunk and the last block merges,
    one launch; without, a block a row reads it whole (fine for narrow rows, slow for a vocabulary).
    """
    x = _rows(logits, "logits")
    rows, cols = x.shape
    splits = argmax_splits(cols) if scratch is not None else 1
    if splits > 1:
        assert scratch is not None
        if scratch.dtype != torch.float32 or scratch.numel() < argmax_scratch_size(rows, cols):
            raise ValueError(f"argmax needs an f32 scratch of {argmax_scratch_size(rows, cols)} values")
        parts = rows * splits
        vals = scratch[:parts]
        idxs = scratch[parts : 2 * parts].view(torch.int32)
        count = scratch[2 * parts : 2 * parts + rows].view(torch.int32)
    else:
        vals = idxs = count = x  # never read: one block a row writes its index directly
    _argmax_kernel[(rows, splits)](
        x,
        out,
        vals,
        idxs,
        count,
        x.stride(0),
        cols,
        CHUNK=ARGMAX_CHUNK,
        SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits),
        TILES=1 if splits > 1 else argmax_splits(cols),
        num_warps=ARGMAX_WARPS,
        **pdl.options(),
    )

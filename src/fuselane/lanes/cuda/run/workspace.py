"""A prefill chunk's workspace under `prefill=f16-scratch`: how many values the f16 scratch holds and which cuBLAS
workspace the lane asks for, so that what a chunk holds beyond the weights and the caches stays within
`kernels.WORKSPACE_SHARE` of them.

Beyond the weights and the caches a chunk holds its activation arena (`buffers`) and outputs, cuBLAS's
workspace, the scratch every product decodes its matrix into, and the operands of the product that runs: its
activation rounded to f16 and its f16 product, a slab's columns of it (`triton/f16_scale`). The arena and the
outputs are set by the model and the chunk's rows; the scratch takes what is left, the most of a layer's
largest product (up to `kernels.F16_SCRATCH_VALUES`) for which every product stays within the share. A smaller
scratch multiplies a matrix in more slabs, each a decode and a cuBLAS call of its own: on a 0.5B at 512 rows,
the gated pair whole 163,820 tok/s, in two slabs 128,730, in four 115,156 (H200, RESULTS.md 2026-12-04). So
the scratch never takes less than a layer's largest product in `kernels.SCRATCH_MOST_SLABS` slabs: where even
that does not fit, the share cannot hold at the chunk's rows, and the scratch keeps the whole product (the
speed) rather than pay for a bar it misses all the same.

Where the scratch is short of its most all the same, a product whose f32 activation no later op reads rounds it
into the activation's own bytes (`f16_scale.to_f16_in_place`) rather than a fresh f16 copy: on a 1.5B the down
product's copy is 9.2 MB of a 56.5 MB share. It reads each row twice where the copy reads it once, so the lane
does so only where it takes the scratch fewer slabs.

Where no way holds a chunk's rows, fewer rows may (`chunk_rows`): the arena and the operands shrink with them,
the scratch does not. The lane tries 512, then 256 (`kernels.SCRATCH_LEAST_ROWS`), and a session runs its prompts
in chunks of the rows that held.

cuBLAS takes a workspace of its own, 32 MiB on Hopper unless `CUBLAS_WORKSPACE_CONFIG` says otherwise, which
torch reads when it makes a stream's workspace (once a process, in some of its versions). Where that workspace
leaves the scratch short of its most, the lane asks for 4 MiB (`kernels.CUBLAS_LEAN_WORKSPACE`) before its first
product: the small shapes' prompts measured the same (0.5B 161,132 against 156,704 tok/s), where the 7B's lost
3.8 %, so the large shapes keep the default; none (`kernels.CUBLAS_NO_WORKSPACE`) last, where only that takes
the scratch fewer slabs. A value the process set (the user, or an earlier lane) stays and is counted as set.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fuselane.fuse.optimizer import Plan
from fuselane.graph.ir import Role
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.knobs import CachePrecision, CudaKnobs, PrefillWeights, RoundInPlace, StatePrecision
from fuselane.lanes.cuda.run.buffers import (
    F16_BYTES,
    F32_BYTES,
    arena_values,
    delta_rule_states,
    dying_reads,
    dying_widths,
)
from fuselane.models import ModelConfig

LAYER_PREFIX = "blk."
GATE_SUFFIXES = ("ffn_gate.weight", "ffn_gate_shexp.weight")  # a gated pair's gate (a shared expert's too): its
# slab is decoded beside the up's
GATED_PAIR = 2
KIB = 1024
CUBLAS_CONFIG = "CUBLAS_WORKSPACE_CONFIG"  # torch's ":KiB:count" pairs
_CONFIG_PAIR = re.compile(r":(\d+):(\d+)")
CACHE_BYTES = {CachePrecision.F16: F16_BYTES, CachePrecision.F32: F32_BYTES}
STATE_BYTES = {StatePrecision.F32: F32_BYTES, StatePrecision.BF16: F16_BYTES}


@dataclass(frozen=True, slots=True)
class Workspace:
    """What the lane takes for a chunk's products, and the bytes it was sized against."""

    rows: int  # the rows of the chunks it was sized for: a session's prompt runs in chunks of as many
    scratch_values: int  # the f16 scratch's values
    cublas_config: str | None  # the CUBLAS_WORKSPACE_CONFIG the lane asks for; None: torch's default or the user's
    cublas_bytes: int  # cuBLAS's workspace as counted
    share_bytes: int  # kernels.WORKSPACE_SHARE of the weights and the caches
    held_bytes: int  # the chunk's arena and outputs
    within: bool  # whether the scratch, the products' operands, cuBLAS's and the held bytes fit the share
    # whether a product whose activation dies at it rounds it into its own bytes (`f16_scale.to_f16_in_place`):
    # only where the scratch would be short of its most with the rounded copies, as each row is read twice
    rounds_in_place: bool = False


def cublas_bytes(config: str | None) -> int:
    """cuBLAS's workspace, in bytes, under a CUBLAS_WORKSPACE_CONFIG value (":4096:8" is 8 of 4,096 KiB); torch's
    Hopper default where there is none or it names no size."""
    pairs = _CONFIG_PAIR.findall(config or "")
    if not pairs:
        return kernels.CUBLAS_DEFAULT_WORKSPACE_BYTES
    return sum(int(kib) * KIB * int(count) for kib, count in pairs)


def sequence_prefill(knobs: CudaKnobs) -> PrefillWeights:
    """How one sequence's chunks read the weights: the `prefill` knob, `auto` being `f16-scratch` (no copy kept;
    a batch's steps resolve `auto` apart, by the GPU's free memory: `run/lane.prefill_for`)."""
    auto = knobs.prefill_weights is PrefillWeights.AUTO
    return PrefillWeights.F16_SCRATCH if auto else knobs.prefill_weights


def keeps_scratch(knobs: CudaKnobs) -> bool:
    """Whether a lane of `knobs` (as given: a loaded lane's own are resolved by `run/lane.prefill_for` through
    `sequence_prefill`) decodes each matrix of a sequence's chunks into the f16 scratch, and so sizes this
    workspace, whatever the model: a mixture's attention and shared products take the scratch as a dense
    model's products do."""
    return sequence_prefill(knobs) is PrefillWeights.F16_SCRATCH


def one_gpu_mixture(cfg: ModelConfig) -> bool:
    """A mixture of experts on one GPU, whose chunks take the routing's own rows (`kernels.MOE_CHUNK_ROWS`)."""
    return bool(cfg.moe) and cfg.shard is None


def fixed_rows(knobs: CudaKnobs, moe: bool) -> int | None:
    """The rows a session's chunks take whatever the workspace holds: the knob `chunk_rows`, else a mixture's own
    chunk on one GPU (`kernels.MOE_CHUNK_ROWS`, its routing's tiles); None: the rows the workspace holds."""
    return knobs.chunk_rows or (kernels.MOE_CHUNK_ROWS if moe else None)


def chunk_rows(most: int) -> list[int]:
    """The rows a chunk is sized at, in the order tried: `most` (the lane's chunk, or its context where less),
    then the powers of two under it down to `kernels.SCRATCH_LEAST_ROWS`: a chunk's arena and operands shrink
    with its rows where the scratch does not."""
    fewer = [1 << i for i in range(most.bit_length() - 1, -1, -1) if kernels.SCRATCH_LEAST_ROWS <= 1 << i < most]
    return [most, *fewer]


def layer_products(shapes: Mapping[str, tuple[int, ...]]) -> dict[int, int]:
    """The largest product's values (a gated pair's two matrices side by side) by the width k it multiplies,
    over a layer's matrices (every matrix where the names have no layers): a vocabulary's output rows, which
    only a chunk asked for every row's logits multiplies, go in slabs of whatever the scratch holds."""
    matrices = {n: s for n, s in shapes.items() if len(s) == 2}
    layers = {n: s for n, s in matrices.items() if n.startswith(LAYER_PREFIX)} or matrices
    by_width: dict[int, int] = {}
    for name, (n, k) in layers.items():
        values = n * k * (GATED_PAIR if name.endswith(GATE_SUFFIXES) else 1)
        by_width[k] = max(by_width.get(k, 0), values)
    return by_width


def operand_bytes(products: Mapping[int, int], rows: int, values: int, in_place: frozenset[int] = frozenset()) -> int:
    """The most one product's transient operands take at `rows` rows with a scratch of `values`: its activation
    rounded to f16 (none for a width in `in_place`, whose products round a dying activation into its own bytes)
    and its rows' scales, and its f16 product, a slab's columns (as many as the scratch holds)."""
    return max(
        F16_BYTES * rows * k * (k not in in_place) + F32_BYTES * rows + F16_BYTES * rows * (min(values, most) // k)
        for k, most in products.items()
    )


def scratch_bounds(shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(the least, the most) values the scratch takes: the most is a layer's largest product, up to
    `kernels.F16_SCRATCH_VALUES`; the least that product in `kernels.SCRATCH_MOST_SLABS` slabs. Both hold at
    least two rows of the widest matrix (a gated pair's slab)."""
    matrices = [s for s in shapes.values() if len(s) == 2]
    pair_row = GATED_PAIR * max(k for _, k in matrices)
    largest = max(layer_products(shapes).values())
    most = min(largest, kernels.F16_SCRATCH_VALUES)
    least = min(most, math.ceil(largest / kernels.SCRATCH_MOST_SLABS))
    return max(least, pair_row), max(most, pair_row)


def fit(
    shapes: Mapping[str, tuple[int, ...]], rows: int, room: int, in_place: frozenset[int] = frozenset()
) -> int | None:
    """The most scratch values within `scratch_bounds` for which the scratch and any product's operands (the
    widths `in_place` rounding into their activations' own bytes) take at most `room` bytes; None where not even
    the least does."""
    products = layer_products(shapes)
    least, most = scratch_bounds(shapes)

    def fits(values: int) -> bool:
        return F16_BYTES * values + operand_bytes(products, rows, values, in_place) <= room

    if not fits(least):
        return None
    lo, hi = least, most  # fits(lo) holds; the bytes grow with the values
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _ways(config: str | None, dying: frozenset[int], always: bool) -> list[tuple[frozenset[int], str | None]]:
    """(the widths rounding in place, the cuBLAS workspace asked for) of each way `size` tries, cheapest first:
    a lean cuBLAS workspace and rounding in place cost the large shapes a few percent, none the small ones'
    whole scratch 5.7 % (`kernels.CUBLAS_NO_WORKSPACE`). A workspace the process set is never asked over."""
    roundings = [dying] if always else [frozenset(), dying]
    if config is not None:
        return [(r, None) for r in roundings]
    lean = [(r, ask) for ask in (None, kernels.CUBLAS_LEAN_WORKSPACE) for r in roundings]
    return lean + [(r, kernels.CUBLAS_NO_WORKSPACE) for r in roundings]


def size(
    shapes: Mapping[str, tuple[int, ...]], rows: int, base_bytes: int, held_bytes: int, config: str | None,
    dying: frozenset[int] = frozenset(), *, always: bool = False,
) -> Workspace:  # fmt: skip
    """The scratch and cuBLAS workspace for chunks of `rows` rows of a model whose weights and caches take
    `base_bytes`, a chunk's arena and outputs `held_bytes`, under the process's CUBLAS_WORKSPACE_CONFIG
    `config` (None: unset, so the lane may ask for a leaner one). `dying`: the widths whose every product's
    activation dies at it, which may round it in place where the scratch is short of its most otherwise (with
    `always`, as the knob `round_in_place=on` has them: whatever the scratch).

    The ways are tried cheapest first (`_ways`): the copies before rounding in place (which reads each row
    twice), cuBLAS's workspace as it is, then lean; none last. The first that holds the whole scratch is taken;
    else the one whose scratch takes the fewest slabs of the largest product (the first of those), as a slab
    costs its launches."""
    share = int(kernels.WORKSPACE_SHARE * base_bytes)
    _, most = scratch_bounds(shapes)
    largest = max(layer_products(shapes).values())
    best: tuple[int, int, str | None, int, frozenset[int]] | None = None  # (slabs, values, ask, counted, in_place)
    for in_place, ask in _ways(config, dying, always):
        counted = cublas_bytes(config if ask is None else ask)
        values = fit(shapes, rows, share - held_bytes - counted, in_place)
        if values is None:
            continue
        slabs = math.ceil(largest / values)
        if best is None or slabs < best[0]:
            best = (slabs, values, ask, counted, in_place)
        if values == most:
            break
    if best is None:  # the share cannot hold even the least scratch: keep the speed, and the lean workspace
        ask = None if config is not None else kernels.CUBLAS_LEAN_WORKSPACE
        counted = cublas_bytes(config if ask is None else ask)
        return Workspace(rows, most, ask, counted, share, held_bytes, False, bool(dying) and always)
    _, values, ask, counted, in_place = best
    return Workspace(rows, values, ask, counted, share, held_bytes, True, bool(in_place))


@dataclass(frozen=True, slots=True)
class Counted:
    """What a chunk's plan holds beside the scratch and its products' operands, as `size` takes it."""

    base_bytes: int  # the weights as uploaded, the caches and the recurrent states the chunk binds
    held_bytes: int  # its arena (or the lane's, where larger), its outputs and a sampled draw's candidates
    dying: frozenset[int]  # the widths whose products may round their activations in place (`dying_widths`)


def counted(chunk: Plan, weights_bytes: int, knobs: CudaKnobs, vocab: int, arena_bytes: int = 0,
            surplus_bytes: int = 0) -> Counted:  # fmt: skip
    """The bytes `size` sizes a chunk of `chunk`'s rows against, on a lane of `knobs` whose weights took
    `weights_bytes`, `surplus_bytes` of them what their stored layout adds to the file's (`run/stored.py`: held
    within the share, not a base of it), and whose arena already holds `arena_bytes` (its steps share it)."""
    g = chunk.graph
    rules = delta_rule_states(chunk)
    base = weights_bytes - surplus_bytes
    held = max(F32_BYTES * arena_values(chunk), arena_bytes) + surplus_bytes
    for name, t in g.tensors.items():
        if t.role is Role.CACHE:
            base += math.prod(t.shape) * CACHE_BYTES[knobs.cache_precision]
        elif t.role is Role.STATE:
            base += math.prod(t.shape) * (STATE_BYTES[knobs.recurrent_state] if name in rules else F32_BYTES)
        elif t.role is Role.OUTPUT:
            held += F32_BYTES * math.prod(t.shape)
    held += vocab * kernels.CANDIDATE_BYTES  # a decode step writes its logits in the chunk's buffer (`output`)
    off = knobs.round_in_place is RoundInPlace.OFF
    return Counted(base, held, frozenset() if off else dying_widths(chunk, dying_reads(chunk)))


def sized(
    plan_at: Callable[[int], Plan], ctx: int, moe: bool, shapes: Mapping[str, tuple[int, ...]], weights_bytes: int,
    knobs: CudaKnobs, vocab: int, config: str | None, arena_bytes: int = 0, surplus_bytes: int = 0,
) -> Workspace:  # fmt: skip
    """The workspace of a lane of `ctx` rows of context (a mixture's where `moe`; `surplus_bytes` of its
    `weights_bytes` its stored layout's, as `counted` takes them), its chunks planned by
    `plan_at(rows)`: at the rows its chunks take (`fixed_rows`, or the context where shorter) where they are
    fixed, else at the first of `chunk_rows` (from `kernels.SCRATCH_CHUNK_ROWS`) whose scratch holds the share;
    where none does, at the first with the whole scratch (`size`)."""
    fixed = fixed_rows(knobs, moe)
    most = min(fixed or kernels.SCRATCH_CHUNK_ROWS, ctx)
    tried = [most] if fixed else chunk_rows(most)
    always = knobs.round_in_place is RoundInPlace.ON
    first = None
    for rows in tried:
        c = counted(plan_at(rows), weights_bytes, knobs, vocab, arena_bytes, surplus_bytes)
        ws = size(shapes, rows, c.base_bytes, c.held_bytes, config, c.dying, always=always)
        if ws.within:
            return ws
        first = first or ws
    assert first is not None  # chunk_rows gives `most` at least
    return first

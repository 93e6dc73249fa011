"""The cuda lane's rule `latent_expanded` and the launches it sizes: a wide chunk's latent attention run
expanded.

Absorbed (the recognizer's form), each of a chunk's query rows multiplies every cached row a head's whole
latent wide. Expanded, each cached latent row goes once through the key half and once through the value half
of the latent's expansion (two per-head products over the cache), and each head's query attends its own
expanded keys (`nope` values, then the shared rotated key read in place from the cache) and values: fewer
multiplies once the chunk is wider than the GEMV's rows. The rule takes the absorbed parts whole as `Mla`
(the query's unrotated slice, its absorption, the join, the latent values' slice, the attention, the value
half) under the quantized numerics and outside a batch, where `latent_launches` sizes its three launches and
each runs in tiles. The op's meaning stays its parts, so a lane that runs it as its parts computes the same.

Every shape fact here is the lane's kernel facts (`kernels`) or stated beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselane.fuse.rewriter import Missed, Rewriter
from fuselane.fuse.shim import SupportKind
from fuselane.fuse.views import parts, slice_view
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import WHOLE, Op, Rows, TensorGraph
from fuselane.graph.ops import Attention, HeadMatmul, Join, Rope
from fuselane.lanes.cuda.plan import attn_kernels, kernels
from fuselane.lanes.cuda.plan.knobs import Activations

RULE = "latent_expanded"
LAUNCHES = 3  # `latent_launches`: the key half, the value half, the attention
# The tensor cores' tile: 16 rows by 16 outputs (an f16 or int8 MMA's M and N); a head's widths are whole tiles.
MMA_TILE = 16
# Cached rows a block of the expanded attention holds in shared memory at a time, keys and values both: the
# chunk attention's tile.
LATENT_TILE_ROWS = 64

# Why the lane does not take a latent attention whole (each a row of the tests).
NO_HEAD_FITS = "one block's shared memory holds no head's tile of expanded keys and values"
HALF_NOT_IN_TILES = "a half of the latent's expansion does not run in tiles (widths whole 16s, rows whole blocks)"
ATTENTION_NOT_IN_TILES = "the expanded attention does not run in tiles (key and value widths whole 16s)"


@dataclass(frozen=True, slots=True)
class Latent:
    """A latent attention's shape and names as its expanded launches read them: the query projection `qr`
    (each head's unrotated part its first `nope` values) and its rotated part `qpp`; the cache `kc`, `kw` wide
    a row (the latent's `lora` values, then the shared rotated key), `len` rows; the key half `wkb` (format
    `fk`; `kro`: its checkpoint rows are the absorbed product's outputs, the latent's) and the value half
    `wvb` (`fv`, `vd` values a head); the result `ct`."""

    qr: str
    qpp: str
    kc: str
    pos: str
    heads: int
    kw: int
    lora: int
    nope: int
    len: int
    rows: int
    scale: float
    wkb: str
    fk: Format
    kro: bool
    wvb: str
    fv: Format
    vd: int
    ct: str


@dataclass(frozen=True, slots=True)
class HeadHalf:
    """A half of the expansion over the cached rows up to `upto` (the position parameter plus the chunk's last
    row): each row's `a` latent values (read in place at `pitch` from the cache, one row `shared` by every head)
    times each head's (b, a) matrix (`rows_out`: stored as b rows of a; else a rows of b), into `y`."""

    x: str
    pitch: int
    w: str
    format: Format
    y: str
    m: int
    heads: int
    a: int
    b: int
    rows_out: bool
    upto: tuple[str, int]
    shared: bool = True

    def in_tiles(self, activations: Activations) -> bool:
        """Whether it runs on the tensor cores in tiles (`triton.mla.expand`): the latent whole 32-value blocks,
        the outputs whole MMA tiles, the checkpoint rows whole blocks of a format the tiles decode."""
        row = self.a if self.rows_out else self.b
        quantized = activations is not Activations.DEQUANT
        decoded = self.format in kernels.ROWS_GEMV_FORMATS and row % LAYOUTS[self.format].values == 0
        return quantized and self.a % kernels.QBLOCK == 0 and self.b % MMA_TILE == 0 and decoded


@dataclass(frozen=True, slots=True)
class SplitAttention:
    """Each head's query (`own` unrotated values at pitch `q_pitch` of `q`, then its rotated part from `q_tail`)
    over its own expanded keys (then the shared rotated key, read in place from the cache at `k_tail`) and
    values; `per_block` heads a block, the span cut into `splits`, a block a split where `parallel`."""

    q: str
    keys: str
    values: str
    pos: str
    out: str
    heads: int
    hd: int
    vd: int
    len: int
    rows: int
    scale: float
    per_block: int
    splits: int
    parallel: bool
    own: int
    q_pitch: int
    q_tail: tuple[str, int]
    k_tail: tuple[str, int, int]

    def in_tiles(self, activations: Activations) -> bool:
        return activations is not Activations.DEQUANT and self.hd % MMA_TILE == 0 and self.vd % MMA_TILE == 0


def heads_per_block(heads: int, qk: int, vd: int, smem_bytes: int, acc_bytes: int) -> int | None:
    """The most heads (dividing `heads`) whose tiles of expanded keys and values fit one block's shared
    memory; None where not even one does."""
    per_head = LATENT_TILE_ROWS * (qk + vd) * acc_bytes
    fits = [h for h in range(1, heads + 1) if heads % h == 0 and h * per_head <= smem_bytes]
    return max(fits) if fits else None


def latent_launches(shim, lt: Latent) -> tuple[HeadHalf, HeadHalf, SplitAttention] | None:
    """The expanded launches (the key half and the value half over every cached row, then the split
    attention), or None where one block's shared memory holds no head."""
    k = shim.knobs
    acc = kernels.accumulator(kernels.mode(k.activations)).nbytes
    rope, qk = lt.kw - lt.lora, lt.nope + lt.kw - lt.lora
    keys, values, upto = f"{lt.ct}.keys", f"{lt.ct}.values", (lt.pos, lt.rows - 1)
    kh = HeadHalf(lt.kc, lt.kw, lt.wkb, lt.fk, keys, lt.len, lt.heads, lt.lora, lt.nope, not lt.kro, upto)
    vh = HeadHalf(lt.kc, lt.kw, lt.wvb, lt.fv, values, lt.len, lt.heads, lt.lora, lt.vd, True, upto)
    per_block = heads_per_block(lt.heads, qk, lt.vd, k.chip.smem_bytes_per_block, acc)
    if per_block is None:
        return None
    splits = attn_kernels.attn_splits(lt.heads // per_block, lt.len, k.chip.sms)
    parallel = splits > 1 and lt.rows * (lt.heads // per_block) < attn_kernels.ATTN_WAVES * k.chip.sms
    attend = SplitAttention(
        lt.qr, keys, values, lt.pos, lt.ct, lt.heads, qk, lt.vd, lt.len, lt.rows, lt.scale, per_block, splits,
        parallel, lt.nope, qk, (lt.qpp, rope), (lt.kc, lt.kw, lt.lora),
    )  # fmt: skip
    return kh, vh, attend


def _whole(op: Op) -> bool:
    return all(a == WHOLE for a in op.access)


def _rows(r: Rewriter, name: str) -> Rows | None:
    storage = r.g.tensors[name].storage if name in r.g.tensors else None
    return storage if isinstance(storage, Rows) else None


def _sole(r: Rewriter, name: str, reader: int) -> bool:
    return r.s.readers(name) == [reader] and name not in r.outputs


def _own(op: Op, spec_type: type) -> bool:
    return isinstance(op.sym, spec_type) and op.dst.own() == op.out and _whole(op)


def match(r: Rewriter, i: int) -> tuple[Latent, list[int], Op] | None:
    """The absorbed latent attention around the attention at slot `i`: its shape, the other members' slots
    (the query's unrotated slice, its absorption, the join, the values' slice, the value half) and the value
    half's op; None where the parts are not the recognizer's absorbed form, each read by the next alone."""
    op = r.s.slot(i)
    a = op.sym if op is not None else None
    if not isinstance(a, Attention) or a.kv_heads != 1 or a.rows <= kernels.GEMV_ROWS or a.value_width >= a.hd:
        return None
    if a.ext is not None or a.batched or not _whole(op):
        return None
    q, kc, vc, pos = op.ins
    heads, kw, lora, rows = a.heads, a.hd, a.value_width, a.rows
    rope = kw - lora
    vi = r.s.producer(vc, before=i)
    values = slice_view(r.s.get(vi)) if vi is not None else None
    if values is None or (values.x, values.every, values.start, values.width) != (kc, kw, 0, lora):
        return None
    ji = r.s.producer(q, before=i)
    join = r.s.get(ji) if ji is not None else None
    if join is None or not _own(join, Join) or not _sole(r, q, i) or not _sole(r, vc, i):
        return None
    j: Join = join.sym  # type: ignore[assignment]
    if (j.rows, j.heads, j.wa // heads, j.wb // heads) != (rows, heads, lora, rope):
        return None
    ql, qpp = join.ins
    ai = r.s.producer(ql, before=ji)
    absorb = r.s.get(ai) if ai is not None else None
    if absorb is None or not _own(absorb, HeadMatmul) or not _sole(r, ql, ji):
        return None
    m: HeadMatmul = absorb.sym  # type: ignore[assignment]
    qn, wkb = absorb.ins
    kstore = _rows(r, wkb)
    if (m.m, m.heads, m.b) != (rows, heads, lora) or kstore is None:
        return None
    nope, qk = m.a, m.a + rope
    qi = r.s.producer(qn, before=ai)
    sq = slice_view(r.s.get(qi)) if qi is not None else None
    if sq is None or (sq.groups, sq.every, sq.start, sq.width) != (rows * heads, qk, 0, nope) or not _sole(r, qn, ai):
        return None
    ri = r.s.producer(qpp, before=ji)
    rot = r.s.get(ri) if ri is not None else None
    if rot is None or not _own(rot, Rope) or not _sole(r, qpp, ji):
        return None
    ei = r.s.producer(rot.ins[0], before=ri)
    sr = slice_view(r.s.get(ei)) if ei is not None else None
    if sr is None or (sr.x, sr.every, sr.start, sr.width) != (sq.x, qk, nope, rope):
        return None
    readers = r.s.readers(op.out)
    expand = r.s.get(readers[0]) if len(readers) == 1 else None
    vstore = _rows(r, expand.ins[1]) if expand is not None else None
    if expand is None or not _own(expand, HeadMatmul) or vstore is None or vstore.transposed:
        return None
    c: HeadMatmul = expand.sym  # type: ignore[assignment]
    if (c.m, c.heads, c.a) != (rows, heads, lora):
        return None
    lt = Latent(sq.x, qpp, kc, pos, heads, kw, lora, nope, a.len, rows, a.scale, wkb, kstore.format,
                not kstore.transposed, expand.ins[1], vstore.format, c.b, expand.out)  # fmt: skip
    return lt, [qi, ai, ji, vi, readers[0]], expand


def why_not(shim, lt: Latent) -> str | None:
    """Why the lane's expanded launches cannot take `lt` (a `fits` reason), or None when they can."""
    launches = latent_launches(shim, lt)
    if launches is None:
        return NO_HEAD_FITS
    kh, vh, attend = launches
    if not (kh.in_tiles(shim.knobs.activations) and vh.in_tiles(shim.knobs.activations)):
        return HALF_NOT_IN_TILES
    return None if attend.in_tiles(shim.knobs.activations) else ATTENTION_NOT_IN_TILES


def latent_expanded(shim, r: Rewriter) -> None:
    """The lane rule: a wide chunk's latent attention whole as `Mla`, under the quantized numerics and outside
    a batch, where its expanded launches fit; asked of the lane like a shared rule's fusion."""
    if shim.knobs.activations is Activations.DEQUANT or shim.knobs.batch:
        return
    found = [(i, m) for i in range(len(r.s)) if (m := match(r, i)) is not None]
    for i, (lt, others, expand) in found:
        members = [i, *others]
        covers = tuple(sorted(c for k in members for c in r.s.get(k).covers))
        why = why_not(shim, lt)
        support = shim.supports(C.MLA)
        if why is None and support.kind is not SupportKind.NATIVE:
            r.events.append(Missed(RULE, C.MLA, covers, support.kind.value, support.reason))
        elif why is not None:
            r.events.append(Missed(RULE, C.MLA, covers, "fits", why))
        else:
            ins = _outside_inputs(r, members)
            r.fuse(RULE, C.MLA, i, others, ins, expand.out, expand.dst, launches=LAUNCHES)


def _outside_inputs(r: Rewriter, members: list[int]):
    """What the members read from outside the group, in the order their parts read it."""
    parts = sorted((r.s.get(k) for k in members), key=lambda p: p.covers[0])
    made = {p.out for p in parts}
    seen: dict[str, object] = {}
    for p in parts:
        for name, access in zip(p.ins, p.access, strict=True):
            if name not in made and name not in seen:
                seen[name] = access
    return list(seen.items())


def unfused(op: Op, g: TensorGraph) -> Latent:
    """The latent attention an `Mla` op stands for, read back from its parts (what its binder launches)."""
    members = parts(op)
    a = next(p for p in members if isinstance(p.sym, Attention))
    q, kc, _, pos = a.ins
    join = next(p for p in members if p.out == q)
    absorb = next(p for p in members if p.out == join.ins[0])
    query = slice_view(next(p for p in members if p.out == absorb.ins[0]))
    expand = next(p for p in members if isinstance(p.sym, HeadMatmul) and p.ins[0] == a.out)
    spec: Attention = a.sym  # type: ignore[assignment]
    m: HeadMatmul = absorb.sym  # type: ignore[assignment]
    c: HeadMatmul = expand.sym  # type: ignore[assignment]
    kstore, vstore = g.tensors[absorb.ins[1]].storage, g.tensors[expand.ins[1]].storage
    assert query is not None and isinstance(kstore, Rows) and isinstance(vstore, Rows)
    return Latent(query.x, join.ins[1], kc, pos, spec.heads, spec.hd, spec.value_width, m.a, spec.len, spec.rows,
                  spec.scale, absorb.ins[1], kstore.format, not kstore.transposed, expand.ins[1], vstore.format, c.b,
                  expand.out)  # fmt: skip

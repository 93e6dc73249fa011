"""Binders of the latent attention's ops (`triton.mla`). Absorbed: the per-head products, the join of a head's
two parts, the rotation of DeepSeek's pairs (YaRN's frequencies where the file has them), the attention over
the latent cache with the latents as values, and the slices the others read in place (views, no launch); a
decode step's two joins in one launch (MlaPrologue).
Expanded (`Mla`, a wide chunk's): the key half and the value half of the latent's expansion over the cached
rows, then each head's attention over its own expanded keys and values.

Each binds the launches the plan counts (`launch.bind` checks: one, a slice none, `Mla` its three); the
position is read on the device and nothing waits on the host, so the launches are captured in a CUDA graph
with the rest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fuselane.fuse.views import leaves
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Op
from fuselane.graph.ops import Attention, Elementwise, HeadMatmul, Join, RmsNorm, Rope, SetRow
from fuselane.lanes.cuda.run.mismatch import PlanMismatch

INTERPRETED_SMS = 4  # the chip the interpreter stands for: a few shares a row, so the merge runs in tests
# the short span under the interpreter: a few rows, so a test's decode steps past it split and merge, and a
# chunk's first rows run whole beside its later rows' shares
INTERPRETED_SHORT_ROWS = 4


def _pitches(x: Any, heads: int, width: int) -> tuple[int, int]:
    """(row pitch, head pitch) of an activation read `width` values a head: a slice's view (one unit a head,
    at its pitch) or a buffer of whole rows."""
    if x.dim() == 2 and x.shape[-1] == width and x.shape[0] > 0 and x.stride(-1) == 1:
        return heads * x.stride(0), x.stride(0)
    return heads * width, width


def head_matmul(op: Op, b, out_q8: Any = None) -> list:
    """HeadMatmul: one launch of every head's GEMV over its own rows of the file's bytes; with `out_q8`
    (GemvQuant: the value half, which `attn_output` reads in int8) writing the result's int8 form too."""
    from fuselane.lanes.cuda.triton.mla import heads

    spec: HeadMatmul = op.sym  # type: ignore[assignment]
    x, out = b.bufs[op.ins[0]], b.bufs[op.out]
    weights = _head_weights(b, op.ins[1], spec)
    x_row, x_head = _pitches(x, spec.heads, spec.a)
    shape = (spec.heads, spec.a, spec.b, out)
    return [lambda: heads.head_matmul(x, x_row, x_head, spec.m, *weights(), *shape, out_q8=out_q8)]


def _head_weights(b, name: str, spec: HeadMatmul):
    """A callable giving a per-head product's (weights, format): the file's bytes where a per-head kernel decodes
    its rows; else (Q2_K, Q3_K, IQ4_NL, IQ4_XS: a DeepSeek file's low-bit mixes) their f32 values, decoded once
    on the device by the first run (binding launches nothing), exactly dequant's."""
    from fuselane.lanes.cuda.plan import kernels

    w, fmt = b.raw[name]
    if fmt in kernels.ROWS_GEMV_FORMATS:
        return lambda: (w, fmt)
    values = _f32_values(b, name, spec.heads * spec.b, spec.a)
    return lambda: (values(), Format.F32)


def _f32_values(b, name: str, n: int, k: int):
    """A callable giving matrix `name`'s (n, k) f32 values on the device, decoded from its bytes on first call
    and kept (in the bound plan's scratch, one a matrix)."""
    from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

    def values() -> Any:
        held = b.scratch.get(f"values:{name}")
        if held is None:
            import torch

            w, fmt = b.raw[name]
            out = torch.empty((n, k), dtype=torch.float32, device=w.device)
            held = b.scratch[f"values:{name}"] = dequantize(w, fmt, n, k, out)
        return held

    return values


def join(op: Op, b) -> list:
    """Join: each head's two parts side by side, one launch."""
    from fuselane.lanes.cuda.triton.mla import parts

    spec: Join = op.sym  # type: ignore[assignment]
    x, y = (b.bufs[n] for n in op.ins)
    out, h = b.bufs[op.out], spec.heads
    wa, wb = spec.wa // h, spec.wb // h
    xa, ya = x.view(spec.rows, h * wa), y.view(spec.rows, h * wb)
    return [lambda: parts.join(xa, ya, out, spec.rows, h, wa, wb)]


def rope(op: Op, b) -> list:
    """A rotation by a table of frequencies (DeepSeek's pairs, or YaRN's stretch): one launch."""
    from fuselane.lanes.cuda.triton.mla import parts

    spec: Rope = op.sym  # type: ignore[assignment]
    x, out, pos = b.bufs[op.ins[0]], b.bufs[op.out], b.bufs["pos"]
    table = _table(op, b, x.device)
    x_row, x_head = _pitches(x, spec.heads, spec.hd)
    shape = dict(rows=spec.rows, heads=spec.heads, hd=spec.hd, half=spec.half, batched=spec.batched)
    return [lambda: parts.rope(x, x_row, x_head, out, pos, table, **shape)]


def _table(op: Op, b, device: Any) -> Any:
    """The table rotation's hd/2 frequencies, computed once in f64 when the step is bound, f32 on the device."""
    import torch

    from fuselane.lanes.cpu.latent_kernels import inv_freq

    spec: Rope = op.sym  # type: ignore[assignment]
    if spec.rot:
        raise PlanMismatch(f"{op.out}: the table rotation turns whole heads")
    key = f"rope-table:{spec.hd}:{spec.base}:{spec.yarn}"
    if key not in b.scratch:
        b.scratch[key] = torch.tensor(inv_freq(spec.hd, spec.base, spec.yarn), dtype=torch.float32, device=device)
    return b.scratch[key]


def join_in_place(op: Op, b) -> list:
    """JoinInPlace: a join's two parts written where the join lies, one launch: the query's (each head's product
    by the key half, then its rotated part: `heads.head_matmul` with a `Turn`) or the cache row's (the normed
    latent, then the rotated key: `parts.norm_rope`). The lane's `fits` admits no other pair."""
    from fuselane.lanes.cuda.triton.mla import heads

    query = _query_join(op, b)
    if query is not None:
        return [lambda: heads.run(query())]
    return [_cache_join(op, b).launch]


def prologue(op: Op, b) -> list:
    """MlaPrologue: the query's join and the cache row's (each as `join_in_place` binds it) in one launch."""
    from fuselane.lanes.cuda.triton.mla import prologue as one_launch

    first, second = op.sym.parts  # type: ignore[union-attr]
    query, row = _query_join(first, b), _cache_join(second, b)
    if query is None:
        raise PlanMismatch(f"{op.out}: the prologue's first join is the query's")
    return [lambda: one_launch.prologue(query(), row)]


def _query_join(op: Op, b):
    """A callable giving the query's join's launch (`heads.launch` with its `Turn`; the weights decoded where they
    must be on the first call); None where `op` is the cache row's join."""
    from fuselane.lanes.cuda.triton.mla import heads

    if _row_write(op) is not None:
        return None
    first, turned, join = join_parts(op)
    if not isinstance(first.sym, HeadMatmul):
        return None
    spec: Rope = turned.sym  # type: ignore[assignment]
    hm: HeadMatmul = first.sym
    out, pos, x = b.bufs[join.out], b.bufs["pos"], b.bufs[turned.ins[0]]
    table = _table(turned, b, x.device)
    x_row, x_head = _pitches(x, spec.heads, spec.hd)
    q, weights = b.bufs[first.ins[0]], _head_weights(b, first.ins[1], hm)
    q_row, q_head = _pitches(q, hm.heads, hm.a)
    turn = heads.Turn(x, x_row, x_head, pos, table, spec.hd, spec.half, spec.batched)
    return lambda: heads.launch(q, q_row, q_head, hm.m, *weights(), hm.heads, hm.a, hm.b, out, turn=turn)


def _cache_join(op: Op, b):
    """The cache row's join (`parts.CacheJoin`): the latent's norm and the key's rotation, written straight into
    the cache at the position where its row write is fused in (`join_row_write`)."""
    from fuselane.lanes.cuda.triton.mla import parts

    row = _row_write(op)
    if row is not None:  # the cache row's join, written straight into the cache at the position
        op = op.sym.parts[0]  # type: ignore[union-attr]
    first, turned, join = join_parts(op)
    spec: Rope = turned.sym  # type: ignore[assignment]
    out, pos, x = b.bufs[join.out], b.bufs["pos"], b.bufs[turned.ins[0]]
    table = _table(turned, b, x.device)
    x_row, _ = _pitches(x, spec.heads, spec.hd)
    n_op, w_op = [p for p in leaves(first) if isinstance(p.sym, RmsNorm | Elementwise)][-2:]
    ns: RmsNorm = n_op.sym  # type: ignore[assignment]
    latent, w = b.bufs[n_op.ins[0]].view(ns.rows, ns.cols), b.vec[w_op.ins[1]]
    at_pos = row is not None
    rows = _cache_rows(b.bufs[row.dst.buf], row.sym.cols) if at_pos else out.view(ns.rows, -1)  # type: ignore[union-attr]
    shape = dict(rows=ns.rows, hd=spec.hd, half=spec.half, batched=spec.batched, at_pos=at_pos)
    return parts.CacheJoin(latent, w, ns.eps, x, x_row, rows, pos, table, **shape)


def _row_write(op: Op) -> Op | None:
    """A JoinInPlace's row write, where the join is written in a cache row (`join_row_write`): its SetRow."""
    last = op.sym.parts[-1]  # type: ignore[union-attr]
    return last if isinstance(last.sym, SetRow) else None


def _cache_rows(cache: Any, cols: int) -> Any:
    """A cache as rows of `cols` values (a layer's cache is one contiguous block)."""
    return cache.view(-1, cols) if cache.is_contiguous() else cache


def join_parts(op: Op) -> tuple[Op, Op, Op]:
    """A JoinInPlace's (first part's producer, the rotation, the join), by the join's inputs."""
    join = next(p for p in op.sym.parts if isinstance(p.sym, Join))  # type: ignore[union-attr]
    made = {p.out: p for p in op.sym.parts}  # type: ignore[union-attr]
    return made[join.ins[0]], made[join.ins[1]], join


def takes_rope(spec: Rope) -> bool:
    """Whether a rotation is the table kernel's (DeepSeek's pairs, by the base's or YaRN's frequencies) rather
    than the lane's NEOX rotation (which turns YaRN's too)."""
    return not spec.half


def latent_attention(op: Op, b, out_q8: Any = None) -> list:
    """An attention whose values are narrower than its keys (the latent cache's): one launch, a row's span in
    shares (`splits`) where the rows are few."""
    from fuselane.lanes.cuda.triton.mla import attention

    spec: Attention = op.sym  # type: ignore[assignment]
    if out_q8 is not None or spec.kv_heads != 1:
        raise PlanMismatch(f"{op.out}: the latent attention writes f32 rows, one kv head")
    q, kc, vc = (b.bufs[n] for n in op.ins[:3])
    out, pos = b.bufs[op.out], b.bufs["pos"]
    kc2 = _cache_rows(kc, spec.hd)
    if _packs(b, spec, kc2, vc):
        return _packed(b, spec, q, kc2, pos, out)
    shares = splits(spec.rows, attention.groups(spec.heads, spec.value_width), spec.len, b.sms, q.device)
    short = short_path(spec.rows, spec.heads, spec.value_width, b.sms, q.device)
    work = _shares_scratch(b, spec, shares, short, q.device) if shares > 1 or short.shares > 1 else None
    shape = dict(rows=spec.rows, heads=spec.heads, kw=spec.hd, vd=spec.value_width, scale=spec.scale,
                 seq_rows=spec.len if spec.batched else 0, splits=shares, work=work, short=short)  # fmt: skip
    return [lambda: attention.latent_attention(q, kc2, vc, pos, out, **shape)]


def _packs(b, spec: Attention, kc: Any, vc: Any) -> bool:
    """Whether the latent attention takes the packed f16 kernel (`triton/mla/packed.py`): asked for under the int8
    numerics (`Bound.latent_packed`), a decode step's or a batch's few rows, heads it holds, and the values the
    first part of the cache's rows (the latents, read in place)."""
    from fuselane.lanes.cuda.plan import kernels
    from fuselane.lanes.cuda.triton.mla import packed

    in_place = vc.data_ptr() == kc.data_ptr() and vc.stride(0) == kc.stride(0)
    few = spec.rows <= kernels.GEMV_ROWS
    return b.latent_packed and few and in_place and packed.takes(spec.heads, spec.hd, spec.value_width)


def _packed(b, spec: Attention, q: Any, kc: Any, pos: Any, out: Any) -> list:
    """The packed latent attention's launch, its splits' scratch one a shape that every layer shares (as
    `_shares_scratch`'s)."""
    from fuselane.lanes.cuda.triton.mla import packed

    sms = b.sms if q.device.type == "cuda" else INTERPRETED_SMS
    shares = packed.splits(spec.rows, spec.value_width, spec.len, sms)
    key = f"mla-packed:{spec.rows}:{spec.heads}:{spec.value_width}:{shares}"
    if shares > 1 and key not in b.scratch:
        b.scratch[key] = packed.scratch(spec.rows, spec.heads, spec.value_width, shares, q.device)
    shape = dict(rows=spec.rows, heads=spec.heads, kw=spec.hd, vd=spec.value_width, scale=spec.scale,
                 splits=shares, work=b.scratch.get(key), seq_rows=spec.len if spec.batched else 0)  # fmt: skip
    return [lambda: packed.latent_attention(q, kc, pos, out, **shape)]


def _shares_scratch(b, spec: Attention, shares: int, short: Any, device: Any):
    """The shares' partials and counters (`attention.scratch`), one a shape that every layer's latent attention
    of the step shares: the layers run one after another, each waiting for the launch before it (`pdl`), and
    each leaves the counters at zero."""
    from fuselane.lanes.cuda.triton.mla import attention

    key = f"mla-shares:{spec.rows}:{spec.heads}:{spec.value_width}:{shares}:{short}"
    if key not in b.scratch:
        b.scratch[key] = attention.scratch(spec.rows, spec.heads, spec.value_width, shares, device, short=short)
    return b.scratch[key]


def splits(rows: int, blocks: int, span: int, sms: int, device: Any) -> int:
    """Shares of a row's span (`attn_kernels.mla_splits`: enough programs to fill the chip of `sms` multiprocessors,
    `Bound.sms`, a program a row's block of heads a share, `blocks` of them, as many as the merge's balance
    allows) for a decode step's or a batch's few rows; a chunk's rows fill it alone. Under the interpreter the
    chip stands for INTERPRETED_SMS."""
    from fuselane.lanes.cuda.plan import attn_kernels, kernels

    if rows > kernels.GEMV_ROWS:
        return 1
    return attn_kernels.mla_splits(rows * blocks, span, sms if device.type == "cuda" else INTERPRETED_SMS)


def short_path(rows: int, heads: int, vd: int, sms: int, device: Any):
    """The short-span path (`whole.Short`) for a launch of `rows` query rows of `heads` heads of `vd` values: the
    plan's where its programs fit the chip of `sms` multiprocessors in one wave (a program a SM: the split path's
    shared memory is the kernel's), so a decode step's or a few batch rows' of V2-Lite's 16 heads; never past
    that (V3's 128 heads take 512 programs; a chunk's rows past the GEMV's fill the chip with shares alone). A
    span past `attn_kernels.MLA_SHORT_SHARE_ROWS` is cut into as many shares as still fit that wave (a power of two).
    Under the interpreter, spans of INTERPRETED_SHORT_ROWS in one share."""
    from fuselane.lanes.cuda.triton.mla import whole

    if device.type != "cuda":
        return whole.Short(rows=INTERPRETED_SHORT_ROWS)
    units = rows * whole.PLAN.units(heads, vd)
    if units > sms:
        return whole.NEVER
    return replace(whole.PLAN, shares=1 << (sms // units).bit_length() - 1)


def mla(op: Op, b) -> list:
    """Mla: the key half and the value half over every cached row up to the chunk's last, then the attention of
    each head's query over its own expanded keys (the shared rotated key read in place from the cache) and
    values, its output where the absorbed form's value half writes. The expanded keys and values are a scratch
    every layer's `Mla` shares, f16 where the chunk's attention multiplies in f16."""
    import torch

    from fuselane.lanes.cuda.plan.latent import unfused
    from fuselane.lanes.cuda.triton.mla import expand, expanded_attention

    lt = unfused(op, b.g)
    rope, qk = lt.kw - lt.lora, lt.nope + lt.kw - lt.lora
    q, qpp, out, pos = b.bufs[lt.qr], b.bufs[lt.qpp], b.bufs[lt.ct], b.bufs["pos"]
    kc = b.bufs[lt.kc]
    kc = kc.view(-1, lt.kw) if kc.is_contiguous() else kc
    if not (q.is_contiguous() and qpp.is_contiguous()):
        raise PlanMismatch(f"{op.out}: the expanded attention reads whole query rows")
    dtype = torch.float16 if b.attention_f16 else torch.float32
    keys = _scratch(b, "keys", (lt.len, lt.heads * lt.nope), dtype, q.device)
    values = _scratch(b, "values", (lt.len, lt.heads * lt.vd), dtype, q.device)
    wk, fk = b.raw[lt.wkb]
    wv, fv = b.raw[lt.wvb]
    halves = dict(heads=lt.heads, a=lt.lora, rows=lt.rows)
    shape = dict(rows=lt.rows, heads=lt.heads, nope=lt.nope, rope=rope, vd=lt.vd, lora=lt.lora, scale=lt.scale,
                 f16_ops=b.attention_f16)  # fmt: skip
    return [
        lambda: expand.expand(kc, wk, Format(fk), pos, keys, b=lt.nope, rows_out=not lt.kro, **halves),
        lambda: expand.expand(kc, wv, Format(fv), pos, values, b=lt.vd, rows_out=True, **halves),
        lambda: expanded_attention.expanded_attention(q, lt.heads * qk, qk, qpp, keys, values, kc, pos, out, **shape),
    ]


def _scratch(b, what: str, shape: tuple[int, int], dtype, device):
    """A buffer every `Mla` of the step shares (the layers run one after another), made once when bound."""
    import torch

    key = f"mla-{what}:{shape}:{dtype}"
    if key not in b.scratch:
        b.scratch[key] = torch.empty(shape, dtype=dtype, device=device)
    return b.scratch[key]

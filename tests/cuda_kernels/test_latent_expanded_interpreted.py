"""The cuda lane's expanded latent attention (`Mla`: the key half and the value half of the latent's expansion
over the cached rows, then each head's attention over its own expanded keys and values) through the whole lane,
every launch under Triton's interpreter, against the cpu lane in f64 within the lane's numerics contract.

Prompt chunks past the GEMV's rows under the lane's defaults (int8 activations, an f16 cache): a first chunk at
position 0, then one at a later position (the halves expand the rows the first chunk cached, the attention is
causal from there). Tiny-deepseek2's latent attention with both layers dense (the mixture's launches, which
their own tests cover, take most of the interpreter's time), and an ungrouped V3-style file (q LoRA, YaRN's
frequencies and attention factor).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import file_bytes_of  # noqa: E402

from fuselane.fuse.views import class_of  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.gguf.synth_latent import LATENT_SHAPES  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.lanes.cuda.plan import latent  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

CHUNKS = {"v2": ([5, 60, 7, 100, 8, 1, 2, 3, 4, 9, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]), "v3": ([5, 60] * 5, ())}
VOCAB = 260
CTX = 64
SHAPES = {
    "v2": dataclasses.replace(LATENT_SHAPES["tiny-deepseek2"], vocab=VOCAB, dense_layers=2),
    "v3": dataclasses.replace(LATENT_SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=64, vocab=VOCAB,
                              dense_layers=2),
}  # fmt: skip


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_wide_chunks_run_expanded_as_the_cpu_lane(tmp_path, name):
    path = write_synthetic(tmp_path / "m.gguf", SHAPES[name], "q8_0", seed=3)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    for chunk in (c for c in CHUNKS[name] if c):
        step = gpu.lane.step(len(chunk))
        taken = [n for op, n in ((op, len(ls)) for op, ls in step.bound) if class_of(op) is C.MLA]
        assert taken == [latent.LAUNCHES] * SHAPES[name].n_layers  # each layer's attention, expanded
        a, b = np.asarray(sg.extend(chunk)), np.asarray(sr.extend(chunk))
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"{name} chunk of {len(chunk)}: {rel(a, b):.2e} > {tol:.2e}"


U16, U32 = 2.0**-11, 2.0**-24


def f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def gamma(terms: int) -> float:
    return terms * U32 / (1 - terms * U32)


def test_mla_is_the_absorbed_attention_where_the_scores_are_peaked(tmp_path):
    # The op's three launches on the lane's own buffers, against its meaning in f64: the query's unrotated part
    # absorbed by the key half, joined with its rotated part, attending the latent cache with the latents as
    # values, the attended latent through the value half. Queries and latents large enough that the softmax
    # picks a few rows (the chunks above attend nearly uniformly), all given f16-exact.
    from fuselane.gguf.dequant import dequantize
    from fuselane.graph.ops import Attention
    from fuselane.lanes.cpu import kernels as cpu

    path = write_synthetic(tmp_path / "m.gguf", SHAPES["v2"], "q8_0", seed=3)
    lane = load(path, lane="cuda", ctx=CTX).lane
    rows, pos, rng = 11, 20, np.random.default_rng(4)
    step = lane.step(rows)
    op, launches = next((op, ls) for op, ls in step.bound if class_of(op) is C.MLA)
    lt = latent.unfused(op, step.plan.graph)
    h, rope, qk = lt.heads, lt.kw - lt.lora, lt.nope + lt.kw - lt.lora
    qr = rng.standard_normal((rows, h * qk)).astype(np.float16).astype(np.float64) * 8
    qpp = rng.standard_normal((rows, h * rope)).astype(np.float16).astype(np.float64) * 8
    cache = (rng.standard_normal((CTX, lt.kw)) * 8).astype(np.float16).astype(np.float64)
    for name, value in ((lt.qr, qr), (lt.qpp, qpp), (lt.kc, cache)):
        buf = step.bufs[name]
        buf.copy_(torch.from_numpy(value).reshape(buf.shape).to(buf.dtype))
    step.bufs["pos"].fill_(pos)
    for launch in launches:
        launch()
    got = step.bufs[lt.ct].double().cpu().numpy().reshape(rows, h, lt.vd)

    # the halves multiply the checkpoint's values rounded to f16 (`expand`): the reference takes those operands
    def values(w, shape):
        raw, fmt = lane.raw[w]
        return f16(dequantize(file_bytes_of(fmt, raw, shape[-1]), fmt, shape, np.float64))

    wk, wv = values(lt.wkb, (h, lt.lora, lt.nope)), values(lt.wvb, (h, lt.vd, lt.lora))
    qn = qr.reshape(rows, h, qk)[..., : lt.nope]
    q = np.concatenate([np.einsum("hij,rhj->rhi", wk, qn), qpp.reshape(rows, h, rope)], -1)
    spec = Attention(rows, h, 1, lt.kw, CTX, lt.scale, vd=lt.lora)
    attended = cpu.attention(spec, [q.reshape(rows, -1), cache, cache[:, : lt.lora].copy()], pos)
    want = np.einsum("hvi,rhi->rhv", wv, attended.reshape(rows, h, lt.lora))

    # each expanded key and value stored in f16 (U16 of itself) after an f32 sum of `lora` products
    span, lat = pos + rows, cache[: pos + rows, : lt.lora]
    keys, values = np.einsum("ni,hij->nhj", lat, wk), np.einsum("ni,hvi->nhv", lat, wv)
    key_err = U16 * np.abs(keys) + gamma(lt.lora + 2) * np.einsum("ni,hij->nhj", np.abs(lat), np.abs(wk))
    value_err = U16 * np.abs(values) + gamma(lt.lora + 2) * np.einsum("ni,hvi->nhv", np.abs(lat), np.abs(wv))
    rotated = np.abs(cache[:span, lt.lora :])
    sums = np.einsum("rhj,nhj->rhn", np.abs(qn), np.abs(keys)) + np.einsum("rhj,nj->rhn", np.abs(qpp.reshape(
        rows, h, rope)), rotated)  # fmt: skip
    score_err = lt.scale * (np.einsum("rhj,nhj->rhn", np.abs(qn), key_err) + gamma(qk + 4) * sums)
    weight_err = 2 * score_err.max(-1) + 2 * U16 + gamma(span + 8)  # each row's and head's weights, relative
    bound = 2 * weight_err[..., None] * np.abs(values).max(0)[None] + value_err.max(0)[None]
    peak = np.exp(np.einsum("rhk,nk->rhn", q, cache[:span]) * lt.scale)
    assert (peak.max(-1) / peak.sum(-1)).mean() > 0.5  # the scores pick rows: a wrong key would show
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{err.max():.3g} against a bound of {bound.min():.3g} .. {bound.max():.3g}"

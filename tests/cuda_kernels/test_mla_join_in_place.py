"""The latent attention's joins written in place (JoinInPlace, one launch each), under the interpreter on a CPU:
the query's (each head's product by the key half, then its rotated part: `heads.head_matmul` with a `Turn`) and
the cache row's (the normed latent, then the rotated key: `parts.norm_rope`) equal, bit for bit, the separate
launches they replace (`head_matmul`, `rope`, `join`; `norm.rms_norm`, `rope`, `join`), which
test_mla_kernels.py holds to the cpu lane's kernels: the same code computes each value. The prologue (MlaPrologue:
both joins in one launch, `prologue.prologue`) equals the two launches, bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.graph.ops import Yarn  # noqa: E402
from fuselane.lanes.cpu.latent_kernels import inv_freq  # noqa: E402
from fuselane.lanes.cuda.triton import norm  # noqa: E402
from fuselane.lanes.cuda.triton.mla import heads, parts, prologue  # noqa: E402

YARN = Yarn(factor=4.0, original=256, beta_fast=32.0, beta_slow=1.0)
BASE = 10_000.0


def _table(hd: int, yarn: Yarn | None) -> torch.Tensor:
    return dev(inv_freq(hd, BASE, yarn).astype(np.float32))


@pytest.mark.parametrize(("fmt", "m", "batched", "yarn"), [
    (Format.Q5_0, 1, False, None), (Format.Q8_0, 10, False, YARN), (Format.F16, 2, True, None),
    (Format.F32, 3, False, YARN),
])  # fmt: skip
def test_the_querys_join_is_its_product_then_its_rotation(fmt, m, batched, yarn):
    rng = np.random.default_rng(21)
    h, nope, rope_w, lora = 3, 32, 16, 16
    pitch = nope + rope_w  # the query projection's heads: unrotated, then rotated, read in place
    q = dev(rng.standard_normal((m, h * pitch)).astype(np.float32))
    raw = dev(raw_weights(fmt, h * lora, nope, rng))
    pos = dev(np.arange(3, 3 + m, dtype=np.int32) * 5 if batched else np.array([7], np.int32))
    table = _table(rope_w, yarn)
    latent, turned, want = torch.zeros((m, h * lora)), torch.zeros((m, h * rope_w)), torch.zeros((m, h * 32))
    heads.head_matmul(q, h * pitch, pitch, m, raw, fmt, h, nope, lora, latent)
    parts.rope(q[:, nope:], h * pitch, pitch, turned, pos, table, rows=m, heads=h, hd=rope_w, half=False,
               batched=batched)  # fmt: skip
    parts.join(latent, turned, want, m, h, lora, rope_w)
    out = torch.full((m, h * 32), float("nan"))
    turn = heads.Turn(q[:, nope:], h * pitch, pitch, pos, table, rope_w, half=False, batched=batched)
    heads.head_matmul(q, h * pitch, pitch, m, raw, fmt, h, nope, lora, out, turn=turn)
    assert torch.equal(out, want)


@pytest.mark.parametrize(("rows", "batched", "yarn"), [(1, False, None), (3, True, YARN), (4, False, YARN)])
def test_the_cache_rows_join_is_its_norm_then_its_rotation(rows, batched, yarn):
    rng = np.random.default_rng(22)
    lora, rope_w, eps = 64, 16, 1e-6
    kv_a = dev(rng.standard_normal((rows, lora + rope_w)).astype(np.float32))  # the latent, then the key
    w = dev(rng.standard_normal(lora).astype(np.float32))
    pos = dev(np.array([0, 9, 4, 2][:rows], np.int32) if batched else np.array([11], np.int32))
    table = _table(rope_w, yarn)
    normed, turned, want = torch.zeros((rows, lora)), torch.zeros((rows, rope_w)), torch.zeros((rows, lora + rope_w))
    norm.rms_norm(kv_a[:, :lora], w, normed, eps)
    parts.rope(kv_a[:, lora:], lora + rope_w, 0, turned, pos, table, rows=rows, heads=1, hd=rope_w, half=False,
               batched=batched)  # fmt: skip
    parts.join(normed, turned, want, rows, 1, lora, rope_w)
    out = torch.full((rows, lora + rope_w), float("nan"))
    parts.norm_rope(kv_a[:, :lora], w, eps, kv_a[:, lora:], lora + rope_w, out, pos, table, rows=rows, hd=rope_w,
                    half=False, batched=batched)  # fmt: skip
    assert torch.equal(out, want)


def test_a_join_in_place_refuses_a_rotation_without_its_table():
    out = torch.zeros((1, 2 * 24), device=DEVICE)
    x = torch.zeros((1, 2 * 16), device=DEVICE)
    turn = heads.Turn(x, 32, 16, torch.zeros(1, dtype=torch.int32), torch.zeros(3), 8, half=False)
    with pytest.raises(ValueError, match="frequencies"):
        heads.head_matmul(x, 32, 16, 1, torch.zeros(2 * 16 * 16), Format.F32, 2, 16, 16, out, turn=turn)


@pytest.mark.parametrize(("fmt", "m", "batched", "at_pos"), [
    (Format.Q5_0, 1, False, True), (Format.Q8_0, 10, False, False), (Format.F16, 2, True, False),
    (Format.F32, 1, False, True), (Format.Q4_K, 3, False, True),
])  # fmt: skip
def test_the_prologue_is_the_two_joins_in_one_launch(fmt, m, batched, at_pos):
    rng = np.random.default_rng(23)
    h, nope, rope_w, lora, eps = 3, 256 if fmt is Format.Q4_K else 32, 16, 32, 1e-6
    pitch = nope + rope_w
    q = dev(rng.standard_normal((m, h * pitch)).astype(np.float32))
    raw = dev(raw_weights(fmt, h * lora, nope, rng))
    kv_a = dev(rng.standard_normal((m, lora + rope_w)).astype(np.float32))
    w = dev(rng.standard_normal(lora).astype(np.float32))
    pos = dev(np.arange(2, 2 + m, dtype=np.int32) * 3 if batched else np.array([5], np.int32))
    table = _table(rope_w, YARN)
    shape = dict(rows=m, hd=rope_w, half=False, batched=batched, at_pos=at_pos)

    def run(one_launch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        absorbed = torch.full((m, h * (lora + rope_w)), float("nan"), device=DEVICE)
        cache = torch.full((16 if at_pos else m, lora + rope_w), float("nan"), device=DEVICE)
        turn = heads.Turn(q[:, nope:], h * pitch, pitch, pos, table, rope_w, half=False, batched=batched)
        query = (q, h * pitch, pitch, m, raw, fmt, h, nope, lora, absorbed)
        row = (kv_a[:, :lora], w, eps, kv_a[:, lora:], lora + rope_w, cache, pos, table)
        if one_launch:
            prologue.prologue(heads.launch(*query, turn=turn), parts.CacheJoin(*row, **shape))
        else:
            heads.head_matmul(*query, turn=turn)
            parts.norm_rope(*row, **shape)
        return absorbed, cache

    (qa, ca), (qb, cb) = run(True), run(False)
    assert torch.equal(qa, qb) and not torch.isnan(qa).any()
    assert torch.equal(ca.isnan(), cb.isnan()) and torch.equal(ca.nan_to_num(), cb.nan_to_num())
    assert (~ca.isnan()).sum() == m * (lora + rope_w)


def test_the_prologue_takes_only_a_query_with_its_rotation():
    x = torch.zeros((1, 32), device=DEVICE)
    query = heads.launch(x, 32, 32, 1, torch.zeros(32 * 32), Format.F32, 1, 32, 32, torch.zeros((1, 32)))
    row = parts.CacheJoin(x[:, :16], torch.ones(16), 1e-6, x[:, 16:], 32, torch.zeros((1, 32)),
                          torch.zeros(1, dtype=torch.int32), torch.ones(8), rows=1, hd=16, half=False)  # fmt: skip
    with pytest.raises(ValueError, match="rotation"):
        prologue.prologue(query, row)

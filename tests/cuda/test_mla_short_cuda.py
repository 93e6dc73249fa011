"""The latent attention's decode kernel compiled, at DeepSeek-V2-Lite's widths (16 heads, kv_lora 512, rope 64), on
a GPU (`pytest -m cuda`; skipped where there is none): the short path whole (depth 64), in two shares merged in
one read (depth 600, `bench`'s decode), and past it the split path (depth 1,500), each against the cpu lane's
attention in f64 over the same f16 cache, within the f32 sums' bound `tests/cuda_kernels/test_mla_kernels.py`
states (where the interpreter runs the same code at tiny widths).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from fuselane.graph.ops import Attention  # noqa: E402
from fuselane.lanes.cpu import kernels as cpu  # noqa: E402
from fuselane.lanes.cuda.plan import attn_kernels  # noqa: E402
from fuselane.lanes.cuda.triton.mla import attention, whole  # noqa: E402

HEADS, LORA, ROPE, CTX = 16, 512, 64, 2048
U32 = 2.0**-24


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


@pytest.mark.parametrize("depth", [64, 600, 1500])
def test_the_short_path_and_the_split_path_attend_the_latents(depth):
    rng = np.random.default_rng(41)
    kw = LORA + ROPE
    cache = (rng.standard_normal((CTX, kw)) * 0.5).astype(np.float16)
    q = (rng.standard_normal((1, HEADS * kw)) * 0.5).astype(np.float32)
    kc = torch.from_numpy(cache).cuda()
    pos = torch.tensor([depth], dtype=torch.int32, device="cuda")
    scale = 1 / np.sqrt(192.0)
    shares = attn_kernels.mla_splits(
        attention.groups(HEADS, LORA), CTX, torch.cuda.get_device_properties(0).multi_processor_count
    )
    short = replace(whole.PLAN, shares=2)  # the lane's on an H200 for these widths (`mla_launch.short_path`)
    work = attention.scratch(1, HEADS, LORA, shares, "cuda", short=short)
    out = torch.zeros((1, HEADS * LORA), device="cuda")
    for _ in range(2):  # the counters re-arm: a second launch runs the same
        attention.latent_attention(torch.from_numpy(q).cuda(), kc, kc[:, :LORA], pos, out, rows=1, heads=HEADS, kw=kw,
                                   vd=LORA, scale=float(scale), splits=shares, work=work, short=short)  # fmt: skip
    torch.cuda.synchronize()
    assert not work[1].any()
    c = cache.astype(np.float64)
    spec = Attention(1, HEADS, 1, kw, CTX, float(scale), vd=LORA)
    want = cpu.attention(spec, [q.astype(np.float64), c, c[:, :LORA].copy()], depth)
    span = depth + 1
    score_err = gamma(kw + 2) * scale * np.abs(q).reshape(HEADS, kw).sum(-1).max() * np.abs(c).max()
    bound = (2 * score_err + gamma(span + 2)) * np.abs(c[:span, :LORA]).max() * 2
    assert np.max(np.abs(out.cpu().double().numpy() - want)) <= bound

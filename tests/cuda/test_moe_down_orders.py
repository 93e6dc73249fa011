"""The decode mixture's down launch compiled, on a GPU (`pytest -m cuda`; skipped where there is none): its new
order (`moe_kernels.MoeDown.READ_AHEAD`: the route weights and the residual read ahead, three chunks in flight
where the format's table says) gives the old order's bits at the real widths, Qwen3-30B-A3B's (eight of 128
experts of 768, Q4_K and Q6_K) and DeepSeek-V2-Lite's (six of 64 of 1,408, Q5_0 and Q8_0), replayed in a
CUDA graph under dependent launches as the lane runs it: the sum, the normed row and its int8 form."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from fuselane.gguf.formats import LAYOUTS, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.lanes.cuda.plan import moe_kernels  # noqa: E402
from fuselane.lanes.cuda.run.stored import stored_bytes  # noqa: E402
from fuselane.lanes.cuda.triton import pdl, quant  # noqa: E402
from fuselane.lanes.cuda.triton.moe import down  # noqa: E402

D = 2048
# (format, experts, kept, expert ffn): the real kept experts and widths, of 16 experts (ids past the first
# few's bytes are what the offsets need; the rest would only lengthen the random weights' build)
CASES = [(Format.Q4_K, 16, 8, 768), (Format.Q6_K, 16, 8, 768), (Format.Q5_0, 16, 6, 1408),
         (Format.Q8_0, 16, 6, 1408)]  # fmt: skip
REPLAYS = 3  # the counters re-arm: each replay gives the same bits


@pytest.mark.parametrize(("fmt", "experts", "top", "dff"), CASES, ids=[c[0].name for c in CASES])
def test_the_new_down_order_gives_the_old_bits(fmt, experts, top, dff):
    rng = np.random.default_rng(11)
    dev = torch.device("cuda")
    blocks = experts * D * dff // LAYOUTS[fmt].values
    raw = random_blocks(fmt, blocks, rng).reshape(-1)
    w = torch.from_numpy(stored_bytes(fmt, raw, dff // LAYOUTS[fmt].values * LAYOUTS[fmt].nbytes)).to(dev)
    ids = torch.from_numpy(rng.permutation(experts)[:top].astype(np.int32)).view(1, top).to(dev)
    rw = torch.rand(1, top, device=dev)
    h = quant.quantize(torch.randn(top, dff, device=dev), quant.empty_q8(top, dff, dev))
    res, norm_w = torch.randn(1, D, device=dev), torch.rand(D, device=dev) + 0.5
    got = {}
    for variant in moe_kernels.MoeDown:
        sum_out, out, out_q8 = torch.zeros(1, D, device=dev), torch.zeros(1, D, device=dev), quant.empty_q8(1, D, dev)
        counter = down.counters(1, dev)

        def launch(sum_out=sum_out, out=out, out_q8=out_q8, counter=counter, variant=variant) -> None:
            down.down_combine(h, w, fmt, ids, rw, D, dff, sum_out, adds=(res,), counter=counter, variant=variant,
                              norm=down.Norm(norm_w, 1e-6, out, out_q8))  # fmt: skip

        with pdl.dependent_launches(True):
            launch()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
        runs = []
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
            runs.append([t.cpu().numpy().copy() for t in (sum_out, out, out_q8.q, out_q8.d)])
        assert not counter.any()
        for run in runs[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(runs[0], run, strict=True)), variant
        got[variant] = runs[0]
    assert np.isfinite(got[moe_kernels.MoeDown.SERIAL][0]).all()
    old, new = got[moe_kernels.MoeDown.SERIAL], got[moe_kernels.MoeDown.READ_AHEAD]
    assert all(np.array_equal(a, b) for a, b in zip(old, new, strict=True))

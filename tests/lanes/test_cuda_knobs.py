"""The cuda lane's knobs (`--knob key=value`) and its kernel facts."""

from __future__ import annotations

import pytest

from fuselane.errors import FuselaneError
from fuselane.fuse.views import GemvForm
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Dst, Rows
from fuselane.lanes.cuda.plan import attn_kernels, kernels, moe_kernels
from fuselane.lanes.cuda.plan.knobs import (
    H200,
    Activations,
    CachePrecision,
    CudaKnobs,
    DeltaProducts,
    DependentLaunch,
    LatentDecode,
    PrefillWeights,
    RopeEpilogue,
    StatePrecision,
    WeightLoads,
)
from fuselane.lanes.cuda.plan.shim import CudaShim, chunks_apart

# --- kernel facts -----------------------------------------------------------------------------------------


def test_kernel_facts() -> None:
    assert kernels.rows_a_warp(Format.Q4_K, 4096, 4096, 1) == 4
    assert kernels.rows_a_warp(Format.Q4_K, 4096, 4096, 2) == 1  # not met one row at a time
    assert kernels.rows_a_warp(Format.Q8_0, 4096, 4096, 1) == 1  # Q8_0 has its own kernel
    assert kernels.rows_a_warp(Format.Q5_0, 896, 896, 1) == 1  # not wide
    wide = GemvForm("x", "w", Rows(Format.Q4_K), 1, 4096, 4096, Dst("y"))
    assert CudaShim().per_warp(wide) == 4 and CudaShim(held=("rows_a_warp",)).per_warp(wide) == 1
    assert kernels.norm_threads(1024) == 128 and kernels.norm_threads(10) == kernels.WARP
    assert kernels.norm_threads(1 << 20) == kernels.MAX_BLOCK_THREADS
    # four rows of the width for each of eight kept experts a program, eight warps (the kernel's tile)
    assert moe_kernels.moe_down_launch(2048, 768, 8, 0) == (2048 // 4, 8 * kernels.WARP)
    # a mixture's grouped GEMM: past the GEMV's rows, or a few rows whose experts no f32 GEMV decodes
    assert moe_kernels.moe_grouped(9) and not moe_kernels.moe_grouped(8, {Format.Q4_K, Format.Q6_K})
    assert moe_kernels.moe_grouped(2, {Format.Q4_K, Format.Q3_K}) and not moe_kernels.moe_grouped(1, {Format.Q3_K})
    # six kept, packed: five rows of the six experts a program (30 of its 32 entries), not four of eight slots
    assert moe_kernels.moe_down_launch(2048, 1408, 6, 0) == (-(-2048 // 5), 8 * kernels.WARP)
    assert moe_kernels.moe_down_launch(2048, 1024, 4, 1024) == (2048 // 8, 8 * kernels.WARP)
    for activations in Activations:
        assert kernels.accumulator(kernels.mode(activations)) == (4, 32)
    assert attn_kernels.attn_splits(head_blocks=32, span=4096, sms=132) == 33  # eight one-warp blocks a SM
    assert attn_kernels.attn_splits(head_blocks=32, span=641, sms=132) == 21  # capped by 32-row (one-tile) chunks
    assert attn_kernels.attn_splits(head_blocks=256, span=4096, sms=132) == 5
    assert attn_kernels.attn_splits(head_blocks=8, span=300, sms=132) == 10
    assert attn_kernels.attn_splits(head_blocks=4096, span=4096, sms=132) == 1
    assert attn_kernels.mla_splits(head_blocks=2, span=64, sms=132) == 4  # V2-Lite's two blocks: a tile a share
    assert attn_kernels.mla_splits(head_blocks=2, span=4096, sms=132) == 161  # the merge's balance, (4096 / 2)^(2/3)
    assert attn_kernels.mla_splits(head_blocks=16, span=4096, sms=132) == 66  # V3's 16 blocks: the chip filled 8 times
    assert attn_kernels.mla_splits(head_blocks=128, span=4096, sms=132) == 9  # and 8 rows of them
    assert attn_kernels.attn_heads_a_block(7) == 1
    assert chunks_apart(splits=4, rows=1, head_blocks=8, sms=132)
    assert not chunks_apart(splits=4, rows=64, head_blocks=64, sms=132)


# --- (e) knobs --------------------------------------------------------------------------------------------


def test_knobs_parse() -> None:
    knobs = CudaKnobs.parse(["activations=int8x2", "cache=f32", "state=bf16", "fuse_quant=off", "batch=on"])
    assert knobs == CudaKnobs(H200, Activations.INT8X2, CachePrecision.F32, StatePrecision.BF16, False, True)
    assert CudaKnobs.parse([]) == CudaKnobs()
    chip = CudaKnobs.parse(["chip=A100", "sms=100", "smem=160"]).chip
    assert (chip.name, chip.sms, chip.smem_kib_per_block) == ("A100", 100, 160)
    assert CudaKnobs().prefill_weights is PrefillWeights.AUTO  # the scratch; a batch's copies where they fit
    assert CudaKnobs.parse(["prefill=f16-copy"]).prefill_weights is PrefillWeights.F16_COPY
    assert CudaKnobs.parse(["prefill=int8"]).prefill_weights is PrefillWeights.INT8
    assert CudaKnobs.parse(["prefill=in-place"]).prefill_weights is PrefillWeights.IN_PLACE
    assert CudaKnobs().norm_launch and not CudaKnobs.parse(["norm_launch=off"]).norm_launch
    assert CudaKnobs().rope_epilogue is RopeEpilogue.AUTO
    assert CudaKnobs().delta_products is DeltaProducts.TF32X3  # the f32 FMA products spill (knobs.py)
    ieee = CudaKnobs.parse(["delta_products=ieee"])
    assert ieee.delta_products is DeltaProducts.IEEE
    assert "IEEE" in CudaShim(ieee).numerics().point and "IEEE" not in CudaShim().numerics().point
    assert [CudaKnobs.parse([f"rope_epilogue={v}"]).rope_epilogue for v in ("on", "off", "AUTO")] == [
        RopeEpilogue.ON,
        RopeEpilogue.OFF,
        RopeEpilogue.AUTO,
    ]
    with pytest.raises(FuselaneError, match="rope_epilogue' takes one of auto, on, off"):
        CudaKnobs.parse(["rope_epilogue=true"])
    assert CudaKnobs().weight_loads is WeightLoads.AS_WRITTEN  # not yet timed on the GPU (knobs.py)
    assert CudaKnobs.parse(["weight_loads=ahead"]).weight_loads is WeightLoads.AHEAD
    assert CudaKnobs.parse(["weight_loads=AS-WRITTEN"]).weight_loads is WeightLoads.AS_WRITTEN
    with pytest.raises(FuselaneError, match="knob 'weight_loads' takes one of as-written, ahead, not 'early'"):
        CudaKnobs.parse(["weight_loads=early"])
    assert CudaKnobs().latent_decode is LatentDecode.PACKED  # 5x the cores' split path at 4,096 rows (knobs.py)
    assert CudaKnobs.parse(["latent_decode=CORES"]).latent_decode is LatentDecode.CORES
    with pytest.raises(FuselaneError, match="knob 'latent_decode' takes one of cores, packed, not 'f16'"):
        CudaKnobs.parse(["latent_decode=f16"])
    assert CudaKnobs().chunk_rows is None and CudaKnobs.parse(["chunk_rows=auto"]).chunk_rows is None
    assert CudaKnobs.parse(["chunk_rows=256"]).chunk_rows == 256


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("bogus=1", "unknown knob 'bogus'"),
        ("activations=int4", "knob 'activations' takes one of dequant, int8, int8x2, not 'int4'"),
        ("cache", "a knob is key=value, not 'cache'"),
        ("cache=", "a knob is key=value, not 'cache='"),
        ("fuse_quant=maybe", "knob 'fuse_quant' takes on or off, not 'maybe'"),
        ("sms=-3", "knob 'sms' takes a positive whole number, not '-3'"),
        ("chip=tpu", "knob 'chip' takes one of h200"),
        ("prefill=int4", "knob 'prefill' takes one of int8, f16-copy, in-place, f16-scratch, auto, not 'int4'"),
        ("pdl=later", "knob 'pdl' takes auto, on or off, not 'later'"),
        ("chunk_rows=0", "knob 'chunk_rows' takes auto or a positive whole number, not '0'"),
        ("chunk_rows=half", "knob 'chunk_rows' takes auto or a positive whole number, not 'half'"),
    ],
)
def test_knobs_parse_errors(setting: str, message: str) -> None:
    with pytest.raises(FuselaneError) as e:
        CudaKnobs.parse([setting])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_prefill_auto_takes_the_scratch_and_a_batch_the_copies_only_where_they_fit() -> None:
    # `prefill=auto`: a sequence's chunks decode into the scratch; a batch's steps multiply the f16 copies where
    # the file's bytes, the copies, the cache and the workspace fit in the GPU's free memory, else the scratch;
    # any other value is the user's
    from types import SimpleNamespace

    import numpy as np

    from fuselane.lanes.cuda.run.lane import PREFILL_HEADROOM_MIN_BYTES, copies_fit, prefill_for

    class Tensor:
        def __init__(self, shape: tuple[int, ...], nbytes: int) -> None:
            self.shape, self.data = shape, np.zeros(nbytes, np.uint8)

    # a matrix of 4,096 x 1,024 in 0.5625 bytes a value, a norm, and an expert stack (never copied)
    tensors = {"w": Tensor((4096, 1024), 2_359_296), "n": Tensor((1024,), 4096), "e": Tensor((8, 64, 1024), 294_912)}
    weights, copies = 2_359_296 + 4096 + 294_912, 2 * 4096 * 1024
    total = 2**30  # a workspace of 5 % is less than the least, so the least counts
    need = weights + copies + 1000 + PREFILL_HEADROOM_MIN_BYTES
    assert copies_fit(tensors, 1000, need, total) and not copies_fit(tensors, 1000, need - 1, total)
    cfg = SimpleNamespace(n_layers=2, cache_values=256)
    cache = 16 * 2 * 256 * 2  # ctx 16, two layers, f16
    # 2 GiB to spare on a GPU of 128 GiB, whose workspace is 5 %: 6.4 GiB
    gpu = SimpleNamespace(cuda=SimpleNamespace(mem_get_info=lambda: (weights + copies + cache + 2**31, 2**37)))
    auto = CudaKnobs()
    assert prefill_for(auto, cfg, tensors, 16, gpu, batch=True) is PrefillWeights.F16_SCRATCH
    roomy = SimpleNamespace(cuda=SimpleNamespace(mem_get_info=lambda: (2**36, 2**37)))
    assert prefill_for(auto, cfg, tensors, 16, roomy, batch=True) is PrefillWeights.F16_COPY
    assert prefill_for(auto, cfg, tensors, 16, None, batch=True) is PrefillWeights.F16_COPY  # the interpreter
    for where in (gpu, roomy, None):
        assert prefill_for(auto, cfg, tensors, 16, where) is PrefillWeights.F16_SCRATCH
    copy = CudaKnobs.parse(["prefill=f16-copy"])
    assert prefill_for(copy, cfg, tensors, 16, gpu) is PrefillWeights.F16_COPY
    assert prefill_for(copy, cfg, tensors, 16, gpu, batch=True) is PrefillWeights.F16_COPY


def test_explain_says_what_prefill_auto_takes_and_what_the_copies_would() -> None:
    from fuselane.lanes.cuda.plan.shim import CudaShim

    single = CudaShim(CudaKnobs()).prefill_products
    assert "into one scratch" in single and "prefill=f16-copy keeps f16 copies instead: faster" in single
    assert "prefill=int8 multiplies on the int8 tensor cores" in single and "a tenth of the speed" in single
    batch = CudaShim(CudaKnobs.parse(["batch=true"])).prefill_products
    assert batch.startswith("multiply f16 copies of the matrices where they fit")
    copies = CudaShim(CudaKnobs.parse(["prefill=f16-copy"])).prefill_products
    assert copies.startswith("multiply f16 copies") and "scratch" not in copies


def test_dependent_launches_follow_the_knob_and_the_models_formats() -> None:
    """`pdl=auto` makes each launch a dependent of the one before but in a model whose dense products multiply a
    matrix in a grid format (whose steps measured slower so); `on` and `off` force either."""
    on, off, auto = DependentLaunch.ON, DependentLaunch.OFF, DependentLaunch.AUTO
    assert CudaKnobs().dependent_launch is auto
    spellings = ("on", "off", "true", "0", "AUTO")
    assert [CudaKnobs.parse([f"pdl={v}"]).dependent_launch for v in spellings] == [on, off, on, off, auto]
    with pytest.raises(FuselaneError, match="auto, on or off, not 'sometimes'"):
        CudaKnobs.parse(["pdl=sometimes"])
    dense, grid = {Format.Q4_K, Format.Q6_K}, {Format.Q4_K, Format.IQ3_S}
    assert CudaShim().dependent_launches(dense) and not CudaShim().dependent_launches(grid)
    assert all(CudaShim(CudaKnobs(dependent_launch=on)).dependent_launches(f) for f in (dense, grid))
    assert not any(CudaShim(CudaKnobs(dependent_launch=off)).dependent_launches(f) for f in (dense, grid))
    # every format the grid GEMV decodes, the ternary ones too (they run the same kernel on f32 rows)
    assert not any(kernels.dependent_launch_pays({fmt}) for fmt in kernels.GRID_GEMV_FORMATS)

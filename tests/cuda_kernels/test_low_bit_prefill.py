"""Checkpoints in the formats only the int8 GEMV multiplies in a decode step (Q2_K, Q3_K, IQ4_NL, IQ4_XS) prefill
on the cuda lane: a prompt's chunk on cuBLAS over f16 copies or the f16 scratch (the device decode,
`gemv/low_bits.py`), then a chunk of a few rows the same way (no f32 GEMV decodes them), against the cpu lane
in f64 within the lane's contract. Interpreted where there is no GPU, one knob a mix (the decode steps of these
mixes are `tests/cuda/test_cuda_mixes.py`'s, on a GPU, and their kernels' `test_gemv_q8.py`'s). A mixture whose
experts are in them multiplies a chunk of any rows past one on the grouped GEMM (no f32 GEMV decodes them), a
step's one row on the int8 GEMV. A latent attention's per-head products in them, or in a grid format (llama.cpp's
IQ mixes write DeepSeek's value half in one), read the matrix's f32 values, decoded once on the device."""

from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.synth import SHAPES, Shape, tensor_formats, write_synthetic  # noqa: E402
from tests.lane_steps import runs_as_the_cpu_lane  # noqa: E402

# rows of whole super-blocks (so the K formats and IQ4_XS are written as such); 4 query heads a kv head, so the
# mixes' gqa rules show; one layer keeps the interpreter's time short
SHAPE = Shape("qwen2", 256, 1, 4, 1, 64, 512, 512, context=64)
PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: a chunk on cuBLAS
SHORT = [12, 13, 14]  # within the GEMV's rows: a chunk of a few rows
# a mixture of the same widths: 8 experts of 256, two kept
MOE = Shape("qwen3moe", 256, 1, 4, 1, 64, 512, 512, context=64, experts=8, experts_used=2, expert_ff=256)
LOW_BITS = {Format.Q2_K, Format.Q3_K, Format.IQ4_NL, Format.IQ4_XS}


def _runs_as_the_cpu_lane(path, decode: list[int], knobs: list[str] | None = None) -> None:
    runs_as_the_cpu_lane(path, PROMPT, SHORT, decode, ctx=32, knobs=knobs)


@pytest.mark.parametrize(("mix", "prefill"), [("q3_k_m", "auto"), ("q2_k", "f16-scratch"), ("iq4_xs", "auto")])
def test_low_bit_mixes_prefill_as_the_cpu_lane(tmp_path, mix: str, prefill: str) -> None:
    assert LOW_BITS & set(tensor_formats(SHAPE, mix).values()), f"{mix} writes none of the formats under test"
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, mix, seed=7)
    _runs_as_the_cpu_lane(path, [], [f"prefill={prefill}"])


def test_a_mixture_in_q2_k_and_q3_k_runs_as_the_cpu_lane(tmp_path) -> None:
    experts = {n: f for n, f in tensor_formats(MOE, "q2_k").items() if "_exps" in n}
    assert {Format.Q2_K, Format.Q3_K} <= set(experts.values())
    path = write_synthetic(tmp_path / "m.gguf", MOE, "q2_k", seed=3)
    _runs_as_the_cpu_lane(path, [9])


def test_a_latent_attention_in_q3_k_runs_as_the_cpu_lane(tmp_path) -> None:
    # one dense layer of DeepSeek's latent attention at widths of whole super-blocks: attn_v_b in Q3_K, and
    # attn_k_b (rows of 32 values) in IQ4_NL, its product joined with the query's rotated part in one launch
    shape = dataclasses.replace(SHAPES["tiny-deepseek2"], n_embd=256, n_ff=512, kv_lora=256, nope=32, n_layers=1)
    formats = tensor_formats(shape, "q3_k_m")
    assert formats["blk.0.attn_v_b.weight"] is Format.Q3_K and formats["blk.0.attn_k_b.weight"] is Format.IQ4_NL
    path = write_synthetic(tmp_path / "m.gguf", shape, "q3_k_m", seed=3)
    _runs_as_the_cpu_lane(path, [9])


@pytest.mark.parametrize("fmt", [Format.IQ2_XXS, Format.IQ3_S])
def test_a_latent_attentions_value_half_in_a_grid_format_runs_as_the_cpu_lane(tmp_path, fmt) -> None:
    # the value half's rows are the latent's 256 values (whole super-blocks); its f32 values decoded once by
    # the grid decode, in the absorbed form's per-head product (its tiles in the expanded form take none)
    shape = dataclasses.replace(SHAPES["tiny-deepseek2"], n_embd=256, n_ff=512, kv_lora=256, nope=32, n_layers=1)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=4, formats={"blk.0.attn_v_b.weight": fmt})
    _runs_as_the_cpu_lane(path, [9])

"""The low-bit mixes on the compiled kernels at real widths, on a GPU (`pytest -m cuda`; skipped where there is
none): a mixture whose experts are Q3_K / Q2_K (the grouped GEMM for a chunk, the int8 GEMV bodies for a
step; Qwen1.5-MoE's folded shared expert with its Q3_K down) and DeepSeek's latent attention with `attn_k_b`
in IQ4_NL and `attn_v_b` in Q3_K (the per-head products on the matrices' f32 values), each against the cpu
lane in f64 within the lane's contract: a prompt's chunk, a chunk of three rows, then decode steps (and MXFP4
experts, llama.cpp's `MXFP4_MOE`). Two layers, 16 experts and a small vocabulary keep the reference short. CI
checks the same paths interpreted at small widths (`tests/cuda_kernels/test_low_bit_prefill.py`,
`test_mxfp4_lane.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.synth import SHAPES, tensor_formats, write_synthetic  # noqa: E402
from tests.lane_steps import runs_as_the_cpu_lane  # noqa: E402

PROMPT = [11, 200, 7, 7, 90, 3, 141, 52, 9, 1000, 17, 4000, 5, 8]  # past the GEMV's rows: a chunk
SHORT = [12, 13, 14]  # a chunk within the GEMV's rows
DECODE = [5, 6, 7]
LOW_BITS = {Format.Q2_K, Format.Q3_K, Format.IQ4_NL}
# Qwen1.5-MoE's Q2_K recipe: its folded shared expert's gate/up Q2_K (the kept experts' int8 tiles) and its down
# Q3_K, an int8 product of the SwiGLU's int8 form in the down launch
CASES = [
    ("qwen3-30b-a3b", "q3_k_m"), ("qwen3-30b-a3b", "q2_k"), ("deepseek-v2-lite", "q3_k_m"),
    ("qwen1.5-moe-a2.7b", "q2_k"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "mix"), CASES)
def test_low_bit_model_runs_as_the_cpu_lane(tmp_path, name: str, mix: str) -> None:
    shape = replace(SHAPES[name], n_layers=2, vocab=4096, experts=16)
    assert LOW_BITS & set(tensor_formats(shape, mix).values()), f"{mix} writes none of the formats under test"
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=13)
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=64)


# Widths no published shape has (`fuzz/lane_shapes.py`): a mixture's IQ4_NL experts (the Q3_K_M recipe's fallback)
# at a hidden width of 1,472, which the grouped GEMM steps two blocks at a time; heads of 80 values, padded to a
# power of two in the prefill attention's tile, and rows of 1,472 values in the in-kernel GEMM
ODD_WIDTHS = {
    "experts-of-1472": (replace(SHAPES["qwen3-30b-a3b"], n_embd=1472, n_layers=2, n_heads=6, n_kv_heads=1,
                                vocab=4096, experts=16, expert_ff=1280), "q3_k_m", []),
    "heads-of-80": (replace(SHAPES["qwen2.5-1.5b"], n_embd=1472, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=80,
                            n_ff=4160, vocab=4096), "q8_0", ["prefill=in-place"]),
    # a head a decode block, each 32-value block two heads share quantized by the later block (a seam counter)
    "heads-of-48-in-threes": (replace(SHAPES["qwen3-0.6b"], n_embd=1536, n_layers=2, n_heads=12, n_kv_heads=4,
                                      head_dim=48, n_ff=4096, vocab=4096), "q4_k_m", []),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ODD_WIDTHS))
def test_a_model_of_odd_widths_runs_as_the_cpu_lane(tmp_path, case: str) -> None:
    shape, mix, knobs = ODD_WIDTHS[case]
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=13)
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=64, knobs=knobs)


def test_mxfp4_experts_run_as_the_cpu_lane(tmp_path) -> None:
    # llama.cpp's MXFP4_MOE at Qwen3-30B-A3B's widths: the experts MXFP4 (kept as IQ4_NL, its e after the row), the
    # rest Q8_0; the grouped GEMM for a chunk, the int8 GEMV bodies for a step
    shape = replace(SHAPES["qwen3-30b-a3b"], n_layers=2, vocab=4096, experts=16)
    assert Format.MXFP4 in tensor_formats(shape, "mxfp4_moe").values()
    path = write_synthetic(tmp_path / "m.gguf", shape, "mxfp4_moe", seed=13)
    runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=64)

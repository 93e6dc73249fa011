"""Activations past f16's range in every family beside the dense one (`test_lane_overflow.py`): a mixture
(Qwen3-MoE; Qwen2-MoE with its gated shared expert folded), DeepSeek-V2's latent attention with its ungated
shared experts, and Qwen3-Next's hybrid of delta-rule and attention layers. Their feed-forward norm is 100, so
the experts' SwiGLU reaches ~1e6 a value and the residual stream ~1e5; the cuda lane (interpreted) gives finite
logits within its contract of the cpu lane's in f64 for a prompt past the GEMV's rows, a chunk of two and two
decode steps, under int8 activations and, for the hybrid, f32 ones (activations=dequant).

The routers' rows are drawn wider than the other matrices (ROUTER_STD): with the ordinary spread, the loud
model's router put a kept expert within rounding of one left out at a decode step, and a choice that flips
on either lane moves the logits by more than any numerics contract covers (the cpu lane in f32 kept f64's
choices, the cuda lane's int8 products did not). The weights are fixed by the seed, so the margins are too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.gguf import synth_qwen3next as hybrid  # noqa: E402
from fuselane.gguf.formats import QK, Format  # noqa: E402
from fuselane.gguf.synth import SHAPES, tensor_shapes, write_weights  # noqa: E402
from tests.lane_steps import runs_as_the_cpu_lane  # noqa: E402

PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the prefill's products run
SHORT = [11, 12]  # a chunk of two after the prompt
DECODE = [9, 10]
# The feed-forward's norm weight (Qwen3-Next names it post_attention_norm) and the spreads: gate and up
# products ~400 a value, as in test_lane_overflow.py; the routers' scores far apart (see above).
FFN_NORMS = ("ffn_norm", "post_attention_norm")
FFN_NORM, GATE_UP_STD, DOWN_STD, ROUTER_STD, STD = 100.0, 0.5, 0.05, 1.0, 0.05


def _std(name: str) -> float:
    if "ffn_gate_inp" in name:  # a router (and Qwen2-MoE's shared expert's gate score)
        return ROUTER_STD
    if "ffn_gate" in name or "ffn_up" in name:
        return GATE_UP_STD
    return DOWN_STD if "ffn_down" in name else STD


def _weights(shape: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, dims in tensor_shapes(SHAPES[shape]).items():
        if len(dims) == 1 and (special := hybrid.random_vector(name, dims[0], rng)) is not None:
            out[name] = special  # the delta rule's decays and steps, as the synthetic checkpoints have them
        elif name.endswith(".bias"):
            out[name] = np.zeros(dims, np.float32)
        elif len(dims) == 1:
            out[name] = (FFN_NORM if any(n in name for n in FFN_NORMS) else 1.0) * np.ones(dims, np.float32)
        else:
            out[name] = (rng.standard_normal(dims) * _std(name)).astype(np.float32)
    return out


def _loud(path, shape: str):
    weights = _weights(shape, np.random.default_rng(3))
    formats = {n: Format.Q8_0 for n, w in weights.items() if w.ndim > 1 and w.shape[-1] % QK == 0}
    return write_weights(path, shape, weights, formats)


@pytest.mark.parametrize(
    ("shape", "knobs"),
    [
        ("tiny-qwen3moe", ()),
        ("tiny-qwen2moe", ()),
        ("tiny-deepseek2", ()),
        ("tiny-qwen3next", ()),
        ("tiny-qwen3next", ("activations=dequant",)),
    ],
)
def test_activations_of_1e6_stay_finite_in_every_family(tmp_path, shape, knobs):
    runs_as_the_cpu_lane(_loud(tmp_path / "loud.gguf", shape), PROMPT, SHORT, DECODE, ctx=32, knobs=list(knobs))

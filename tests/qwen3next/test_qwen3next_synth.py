"""`fuselane.gguf.synth` writes qwen3next: the Qwen3-Next-80B-A3B shape built in (its parameter count and its
Q4_K_M size), a tiny shape written, read back and run, the command line, and hybrid shapes that cannot be."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fuselane.errors import FuselaneError
from fuselane.gguf.formats import Format, tensor_bytes
from fuselane.gguf.synth import SHAPES, main, tensor_formats, tensor_shapes
from fuselane.info import describe
from fuselane.runtime.model import load

REAL = SHAPES["qwen3-next-80b-a3b"]


def test_the_real_shape_is_qwen3_next_80b_a3b():
    dims = tensor_shapes(REAL)
    params = sum(int(np.prod(d)) for d in dims.values())
    assert 79.5e9 < params < 80.0e9  # 79.67B: the 80B of its name, without the multi-token-prediction layer
    full = [i for i in range(REAL.n_layers) if f"blk.{i}.attn_q.weight" in dims]
    assert full == list(range(3, 48, 4))  # every fourth layer full attention, 16 heads of 256 values
    assert dims["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048)  # each head's query and its gate
    assert dims["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert dims["blk.0.ffn_gate_exps.weight"] == (512, 512, 2048)


def test_its_q4_k_m_mix_keeps_the_convolution_and_routers_in_f32():
    formats = tensor_formats(REAL, "q4_k_m")
    assert formats["blk.0.ssm_conv1d.weight"] is Format.F32 and formats["blk.0.ffn_gate_inp.weight"] is Format.F32
    # llama.cpp's attn_v rules take the fused q/k/v matrix too: Q6_K on the `use_more_bits` layers (0, not 6) of
    # the 48 attn_v-like matrices, each layer's one; the gate and the others stay Q4_K
    assert formats["blk.0.attn_qkv.weight"] is Format.Q6_K and formats["blk.6.attn_qkv.weight"] is Format.Q4_K
    assert formats["blk.0.attn_gate.weight"] is Format.Q4_K
    size = sum(tensor_bytes(formats[n], d) for n, d in tensor_shapes(REAL).items())
    assert 48e9 < size < 49e9  # 48.4 GB


def test_a_tiny_file_reads_back_and_runs(tmp_path):
    assert main([str(tmp_path / "t.gguf"), "--shape", "tiny-qwen3next", "--mix", "q4_k_m"]) == 0
    model = load(tmp_path / "t.gguf", lane="cpu", ctx=64)
    try:
        cfg, shape = model.cfg, SHAPES["tiny-qwen3next"]
        assert cfg.linear.layers == (True, False, True, False)
        assert (cfg.linear.k_heads, cfg.linear.v_heads, cfg.linear.k_dim, cfg.linear.conv) == (2, 4, 16, 4)
        assert (cfg.rope_dim, cfg.shared_ff, cfg.experts) == (shape.rope_dim, shape.shared_ff, shape.experts)
        assert np.all(np.isfinite(model.logits([1, 2, 3])))
        linear = describe(str(tmp_path / "t.gguf"))["linear"]
        assert linear == {"layers": 2, "key_heads": 2, "value_heads": 4, "head_dim": 16, "conv_taps": 4, "rope_dim": 8}
    finally:
        model.close()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"ssm_v_heads": 3}, "do not group evenly"),
        ({"conv": 0}, "conv must be positive"),
        ({"rope_dim": 17}, "rope_dim 17"),
        ({"shared_ff": 0}, "shared expert"),
    ],
)
def test_a_hybrid_shape_that_cannot_be_is_refused(fields, says):
    with pytest.raises(FuselaneError, match=says):
        replace(SHAPES["tiny-qwen3next"], **fields)

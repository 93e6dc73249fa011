"""The qwen3next parts of synthetic checkpoints: its tensors (gated delta-rule layers, gated full-attention
layers, a mixture with a shared expert in every layer) and metadata, as llama.cpp's converter writes them.

`synth.Shape` carries the hybrid's fields (`full_every`, `ssm_k_heads`, `ssm_v_heads`, `ssm_dim`, `conv`,
`rope_dim`); this module turns them into tensor shapes and keys, and checks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuselane.errors import FuselaneError

ARCH = "qwen3next"
# Tensors kept in F32 whatever the mix: the convolution's taps (llama.cpp keeps ssm_conv1d in F32; its rows of
# `conv` values are no quantized block).
F32_MATRICES = ("ssm_conv1d.weight",)
A_SPREAD = 0.5  # ssm_a = -exp(N(0, this)): every head decays, at rates of about 0.2 to 5 a step


def check(shape: Any) -> None:
    """Refuse a hybrid shape whose fields cannot make a model."""
    for size in ("full_every", "ssm_k_heads", "ssm_v_heads", "ssm_dim", "conv", "rope_dim"):
        if getattr(shape, size) <= 0:
            raise FuselaneError(f"shape field {size} must be positive for {ARCH}, not {getattr(shape, size)}")
    if shape.ssm_v_heads % shape.ssm_k_heads:
        raise FuselaneError(f"{shape.ssm_v_heads} value heads do not group evenly over {shape.ssm_k_heads} key heads")
    if shape.rope_dim > shape.head_dim or shape.rope_dim % 2:
        raise FuselaneError(f"rope_dim {shape.rope_dim} must be even and at most head_dim {shape.head_dim}")


def linear(shape: Any, i: int) -> bool:
    """Whether layer i is a gated delta-rule layer (every `full_every`-th layer is full attention)."""
    return (i + 1) % shape.full_every != 0


def layer_shapes(shape: Any, b: str, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's attention-side tensors (its mixture's are the mixture's), numpy order, in file order."""
    d, hd = shape.n_embd, shape.head_dim
    out: dict[str, tuple[int, ...]] = {b + "attn_norm.weight": (d,)}
    if linear(shape, i):
        kw, vw = shape.ssm_k_heads * shape.ssm_dim, shape.ssm_v_heads * shape.ssm_dim
        out |= {
            b + "attn_qkv.weight": (2 * kw + vw, d),
            b + "attn_gate.weight": (vw, d),
            b + "ssm_conv1d.weight": (2 * kw + vw, shape.conv),
            b + "ssm_a": (shape.ssm_v_heads,),
            b + "ssm_dt.bias": (shape.ssm_v_heads,),
            b + "ssm_ba.weight": (2 * shape.ssm_v_heads, d),
            b + "ssm_norm.weight": (shape.ssm_dim,),
            b + "ssm_out.weight": (d, vw),
        }
    else:
        q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
        out |= {
            b + "attn_q.weight": (2 * q, d),
            b + "attn_k.weight": (kv, d),
            b + "attn_v.weight": (kv, d),
            b + "attn_q_norm.weight": (hd,),
            b + "attn_k_norm.weight": (hd,),
            b + "attn_output.weight": (d, q),
        }
    out[b + "post_attention_norm.weight"] = (d,)
    return out


def metadata(shape: Any) -> dict[str, Any]:
    """The hybrid's own keys."""
    a = ARCH
    return {
        f"{a}.ssm.conv_kernel": shape.conv,
        f"{a}.ssm.state_size": shape.ssm_dim,
        f"{a}.ssm.group_count": shape.ssm_k_heads,
        f"{a}.ssm.time_step_rank": shape.ssm_v_heads,
        f"{a}.ssm.inner_size": shape.ssm_v_heads * shape.ssm_dim,
        f"{a}.full_attention_interval": shape.full_every,
        f"{a}.rope.dimension_count": shape.rope_dim,
    }


def random_vector(name: str, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """A vector the generic rule (norms near one, biases near zero) would make wrong: ssm_a, which is -exp(A_log)."""
    if name.endswith(".ssm_a"):
        return -np.exp(rng.standard_normal(n) * A_SPREAD).astype(np.float32)
    return None

"""The `deepseek2` shapes `fuselane.gguf.synth` writes: DeepSeek's latent attention and mixture, as llama.cpp's
converter lays them out (`attn_k_b` / `attn_v_b` split from the latent's expansion, the MLA-shaped head sizes),
with DeepSeek-V2-Lite's shape built in and tiny ones for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.gguf import synth_ffn as ffn

ARCH = "deepseek2"
SIGMOID_GATING = 2  # `expert_gating_func` as llama.cpp numbers it: 1 softmax, 2 sigmoid
YARN_LOG_MULTIPLIER = 0.1  # the converter's 0.1 * mscale_all_dim, at DeepSeek-V3's mscale_all_dim of 1
V2_LITE_LOG_MULTIPLIER = 0.0707  # ... at DeepSeek-V2-Lite's 0.707


@dataclass(frozen=True, slots=True)
class LatentShape:
    """Hyper-parameters of a deepseek2 model: `q_lora` 0 for a plain query; the first `dense_layers` layers
    dense (`n_ff` wide), the rest mixtures of `experts` experts (`experts_used` kept, each `expert_ff` wide)
    with `shared_experts` shared ones; `sigmoid` routing with a correction bias and `groups` expert groups
    (`groups_used` kept) for V3's routing; `yarn_factor` above 1 stretches the rotary frequencies."""

    n_embd: int
    n_layers: int
    n_heads: int
    n_ff: int
    vocab: int
    kv_lora: int
    nope: int
    rope: int
    vdim: int
    q_lora: int = 0
    dense_layers: int = 1
    experts: int = 8
    experts_used: int = 2
    expert_ff: int = 32
    shared_experts: int = 1
    weights_scale: float = 1.0
    weights_norm: bool = False
    sigmoid: bool = False
    groups: int = 1
    groups_used: int = 1
    yarn_factor: float = 1.0
    yarn_original: int = 4096
    yarn_log_mul: float = YARN_LOG_MULTIPLIER
    context: int = 4096
    rope_base: float = 10_000.0
    rms_eps: float = 1e-6
    tied: bool = False
    arch: str = ARCH

    def __post_init__(self) -> None:
        sizes = ("n_embd", "n_layers", "n_heads", "n_ff", "vocab", "kv_lora", "nope", "rope", "vdim", "context")
        for size in sizes:
            if getattr(self, size) <= 0:
                raise FuselaneError(f"shape field {size} must be positive, not {getattr(self, size)}")
        if self.rope % 2:
            raise FuselaneError(f"rope {self.rope} is odd; rope rotates pairs of dimensions")
        if self.experts_used > self.experts or self.experts % self.groups or self.groups_used > self.groups:
            raise FuselaneError(
                f"{self.experts_used} of {self.experts} experts in {self.groups_used} of "
                f"{self.groups} groups is no routing"
            )

    @property
    def n_kv_heads(self) -> int:
        return 1  # the file is MLA-shaped: one latent row a token

    @property
    def moe(self) -> bool:
        return self.dense_layers < self.n_layers


LATENT_SHAPES: dict[str, LatentShape] = {
    # DeepSeek-V2-Lite: no q LoRA, the first layer dense, 64 routed experts top-6 and 2 shared
    "deepseek-v2-lite": LatentShape(
        2048, 27, 16, 10944, 102400, kv_lora=512, nope=128, rope=64, vdim=128, experts=64, experts_used=6,
        expert_ff=1408, shared_experts=2, context=163840, yarn_factor=40.0, yarn_original=4096,
        yarn_log_mul=V2_LITE_LOG_MULTIPLIER,
    ),
    "tiny-deepseek2": LatentShape(64, 2, 4, 128, 512, kv_lora=32, nope=16, rope=16, vdim=16),
    "tiny-deepseek3": LatentShape(
        64, 2, 4, 128, 512, kv_lora=32, nope=16, rope=16, vdim=16, q_lora=48, experts=8, experts_used=2,
        weights_norm=True, weights_scale=2.5, sigmoid=True, groups=4, groups_used=2, yarn_factor=4.0,
        yarn_original=256,
    ),
}  # fmt: skip


def tensor_shapes(shape: LatentShape) -> dict[str, tuple[int, ...]]:
    """Every tensor's GGUF name and numpy-order shape, in the order llama.cpp's converter writes them."""
    d, h, qk = shape.n_embd, shape.n_heads, shape.nope + shape.rope
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, d)}
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (d,)
        if shape.q_lora:
            out |= {b + "attn_q_a.weight": (shape.q_lora, d), b + "attn_q_a_norm.weight": (shape.q_lora,)}
            out[b + "attn_q_b.weight"] = (h * qk, shape.q_lora)
        else:
            out[b + "attn_q.weight"] = (h * qk, d)
        out[b + "attn_kv_a_mqa.weight"] = (shape.kv_lora + shape.rope, d)
        out[b + "attn_kv_a_norm.weight"] = (shape.kv_lora,)
        out[b + "attn_k_b.weight"] = (h, shape.kv_lora, shape.nope)
        out[b + "attn_v_b.weight"] = (h, shape.vdim, shape.kv_lora)
        out[b + "attn_output.weight"] = (d, h * shape.vdim)
        out[b + "ffn_norm.weight"] = (d,)
        out |= _dense(shape, b) if i < shape.dense_layers else _mixture(shape, b)
    out["output_norm.weight"] = (d,)
    if not shape.tied:
        out["output.weight"] = (shape.vocab, d)
    return out


def _dense(shape: LatentShape, b: str) -> dict[str, tuple[int, ...]]:
    return ffn.dense(b, shape.n_embd, shape.n_ff)


def _mixture(shape: LatentShape, b: str) -> dict[str, tuple[int, ...]]:
    out = ffn.experts(b, shape.n_embd, shape.experts, shape.expert_ff)
    if shape.shared_experts:  # DeepSeek's shared experts are ungated, one block as wide as all of them
        out |= ffn.shared_expert(b, shape.n_embd, shape.expert_ff * shape.shared_experts, gated=False)
    if shape.sigmoid:
        out[b + "exp_probs_b.bias"] = (shape.experts,)
    return out


def metadata(shape: LatentShape) -> dict[str, Any]:
    """The `deepseek2.*` keys llama.cpp's converter writes for `shape` (the MLA-shaped sizes)."""
    a = f"{ARCH}."
    meta: dict[str, Any] = {
        a + "block_count": shape.n_layers,
        a + "context_length": shape.context,
        a + "embedding_length": shape.n_embd,
        a + "feed_forward_length": shape.n_ff,
        a + "attention.head_count": shape.n_heads,
        a + "attention.head_count_kv": 1,
        a + "attention.kv_lora_rank": shape.kv_lora,
        a + "attention.key_length": shape.kv_lora + shape.rope,
        a + "attention.value_length": shape.kv_lora,
        a + "attention.key_length_mla": shape.nope + shape.rope,
        a + "attention.value_length_mla": shape.vdim,
        a + "rope.dimension_count": shape.rope,
        a + "rope.freq_base": float(shape.rope_base),
        a + "attention.layer_norm_rms_epsilon": float(shape.rms_eps),
        a + "leading_dense_block_count": shape.dense_layers,
        a + "vocab_size": shape.vocab,
    }
    if shape.q_lora:
        meta[a + "attention.q_lora_rank"] = shape.q_lora
    if shape.moe:
        meta |= {
            a + "expert_count": shape.experts,
            a + "expert_used_count": shape.experts_used,
            a + "expert_feed_forward_length": shape.expert_ff,
            a + "expert_shared_count": shape.shared_experts,
            a + "expert_weights_scale": float(shape.weights_scale),
            a + "expert_weights_norm": shape.weights_norm,
            a + "expert_group_count": shape.groups,
            a + "expert_group_used_count": shape.groups_used,
        }
        if shape.sigmoid:
            meta[a + "expert_gating_func"] = SIGMOID_GATING
    if shape.yarn_factor > 1:
        s = a + "rope.scaling."
        meta |= {
            s + "type": "yarn",
            s + "factor": float(shape.yarn_factor),
            s + "original_context_length": shape.yarn_original,
            s + "yarn_log_multiplier": shape.yarn_log_mul,
        }
    return meta


def parameters(shape: LatentShape) -> int:
    """The model's parameter count (every tensor's values)."""
    return sum(math.prod(dims) for dims in tensor_shapes(shape).values())

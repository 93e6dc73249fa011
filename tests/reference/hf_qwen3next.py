"""A tiny random Hugging Face Qwen3-Next model and its weights under GGUF names, as llama.cpp's converter
writes them.

The converter's changes: every RMS norm weight but the gated `linear_attn.norm` gets the +1 the Hugging Face
model adds at run time; `in_proj_qkvz` (per key head: its query, key, value heads and z heads) is split into
`attn_qkv` (every query head, then every key head, then every value head: the convolution's channel order) and
`attn_gate` (z); `in_proj_ba` stays as it is (`ssm_ba`); `A_log` becomes `ssm_a` = -exp(A_log); the
convolution's (channels, 1, taps) weight loses its middle axis.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from fuselane.gguf.synth import Shape
from tests.reference.hf_moe import MOE_TO_GGUF
from tests.reference.hf_tiny import HF_TO_GGUF, randomize

EXPERTS, KEPT, EXPERT_FF, SHARED_FF = 4, 2, 32, 32
K_HEADS, V_HEADS, SSM_DIM, CONV = 2, 4, 16, 4
HEAD_DIM, ROPE_PART = 16, 0.5
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# Spreads: the zero-centred norms (the model adds 1), the decay's A (A = exp(A_log)) and the router, whose
# scores this spreads so the kept experts lead the dropped ones well past rounding.
SPREADS = {
    "layernorm.weight": 0.2,
    "q_norm.weight": 0.2,
    "k_norm.weight": 0.2,
    "model.norm.weight": 0.2,
    "A_log": 0.5,
    "mlp.gate.weight": 0.5,
}
ONE_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    **MOE_TO_GGUF,
}


def tiny_qwen3next(*, seed: int = 0, full_every: int = 2, layers: int = len(LAYER_TYPES), head_dim: int = HEAD_DIM,
                   k_heads: int = K_HEADS, v_heads: int = V_HEADS, ssm_dim: int = SSM_DIM,
                   rope_part: float = ROPE_PART, **widths):  # fmt: skip
    """A random Qwen3-Next, four layers by default: linear, full, linear, full; four experts, two kept, a shared
    expert. `full_every`: every this-many-th layer is a full attention's (llama.cpp's interval); `widths`
    overrides the config's other fields (heads, the convolution's taps, the experts)."""
    torch.manual_seed(seed)
    types = ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)]
    fields = dict(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=ssm_dim, linear_value_head_dim=ssm_dim, linear_conv_kernel_dim=CONV,
        num_experts=EXPERTS, num_experts_per_tok=KEPT, moe_intermediate_size=EXPERT_FF,
        shared_expert_intermediate_size=SHARED_FF, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        layer_types=types, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": rope_part},
        tie_word_embeddings=False,
    ) | widths  # fmt: skip
    return randomize(Qwen3NextForCausalLM(Qwen3NextConfig(**fields)), SPREADS)


def shape_of(model) -> Shape:
    c = model.config
    full_every = c.layer_types.index("full_attention") + 1 if "full_attention" in c.layer_types else 0
    return Shape(
        "qwen3next",
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        context=c.max_position_embeddings,
        rope_base=c.rope_parameters["rope_theta"],
        rms_eps=c.rms_norm_eps,
        experts=c.num_experts,
        experts_used=c.num_experts_per_tok,
        expert_ff=c.moe_intermediate_size,
        shared_ff=c.shared_expert_intermediate_size,
        full_every=full_every,
        ssm_k_heads=c.linear_num_key_heads,
        ssm_v_heads=c.linear_num_value_heads,
        ssm_dim=c.linear_key_head_dim,
        conv=c.linear_conv_kernel_dim,
        rope_dim=int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
    )


def _split_qkvz(w: np.ndarray, c) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_qkvz's rows, grouped per key head, as attn_qkv's (queries, keys, values) and attn_gate's (z)."""
    kh, dk = c.linear_num_key_heads, c.linear_key_head_dim
    per = c.linear_num_value_heads // kh * c.linear_value_head_dim
    groups = w.reshape(kh, 2 * dk + 2 * per, -1)
    q, k, v, z = np.split(groups, np.cumsum([dk, dk, per]), axis=1)
    d = w.shape[-1]
    return np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)]), z.reshape(-1, d)


def gguf_weights(model) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF names, numpy order, as the converter writes them."""
    out = {}
    for name, p in model.state_dict().items():
        value = p.detach().cpu().numpy().astype(np.float32)
        if name.endswith(ONE_CENTRED):
            value = value + np.float32(1)
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = value
            continue
        layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        b = f"blk.{layer}."
        if rest == "linear_attn.in_proj_qkvz.weight":
            out[b + "attn_qkv.weight"], out[b + "attn_gate.weight"] = _split_qkvz(value, model.config)
        elif rest == "linear_attn.A_log":
            out[b + "ssm_a"] = -np.exp(value)
        elif rest == "linear_attn.conv1d.weight":
            out[b + "ssm_conv1d.weight"] = value[:, 0, :]
        elif rest == "mlp.experts.gate_up_proj":
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = np.split(value, 2, axis=1)
        elif rest == "mlp.shared_expert_gate.weight":
            out[b + "ffn_gate_inp_shexp.weight"] = value.reshape(-1)
        else:
            out[b + LAYER_NAMES[rest]] = value
    return out

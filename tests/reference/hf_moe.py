"""Tiny random Hugging Face Qwen2-MoE/Qwen3-MoE models, their weights under GGUF names, and their router scores.

Hugging Face holds each layer's experts as two 3-D tensors: `gate_up_proj` (experts, 2 * expert_ff, n_embd),
the gate's rows first, and `down_proj` (experts, n_embd, expert_ff); llama.cpp's converter splits the first
into `ffn_gate_exps` and `ffn_up_exps`.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fuselane.gguf.synth import Shape
from tests.reference.hf_tiny import HF_TO_GGUF, LAYER_TO_GGUF, randomize, shape_of

EXPERTS, KEPT, EXPERT_FF, SHARED_FF = 8, 2, 32, 48
ROUTER_SCALE = 0.5  # router weights spread the scores, so kept and dropped experts are well apart
MOE_TO_GGUF = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def tiny_moe(arch: str, *, seed: int = 0, layers: int = 2, experts: int = EXPERTS, kept: int = KEPT,
             expert_ff: int = EXPERT_FF, shared_ff: int = SHARED_FF, heads: int = 4, kv_heads: int = 2):  # fmt: skip
    """A random tiny mixture of `arch` (qwen2moe: a shared expert of `shared_ff`, top-k not renormalised;
    qwen3moe: renormalised, no shared expert)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=expert_ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts=experts,
        num_experts_per_tok=kept,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    if arch == "qwen2moe":
        config = Qwen2MoeConfig(shared_expert_intermediate_size=shared_ff, norm_topk_prob=False, **common)
        model = Qwen2MoeForCausalLM(config)
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=32, norm_topk_prob=True, **common))
    return randomize(model, {"mlp.gate.weight": ROUTER_SCALE})


def moe_shape(model, arch: str) -> Shape:
    """The synthetic writer's Shape of a tiny mixture: the dense reading and the experts' widths."""
    c = model.config
    shared = c.shared_expert_intermediate_size if arch == "qwen2moe" else 0
    return shape_of(model, arch, experts=c.num_experts, experts_used=c.num_experts_per_tok,
                    expert_ff=c.moe_intermediate_size, shared_ff=shared)  # fmt: skip


def moe_weights(model) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF tensor names, in numpy order."""
    out = {}
    for name, p in model.state_dict().items():
        value = p.detach().cpu().numpy().astype(np.float32)
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = value
            continue
        layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        b = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = np.split(value, 2, axis=1)
        elif rest == "mlp.shared_expert_gate.weight":
            out[b + MOE_TO_GGUF[rest]] = value.reshape(-1)  # llama.cpp reads it as a vector
        else:
            out[b + {**LAYER_TO_GGUF, **MOE_TO_GGUF}[rest]] = value
    return out


def router_gaps(model, ids: list[int]) -> float:
    """The smallest gap, over every row and layer of a forward pass of `ids`, between the k-th and the
    (k+1)-th router score: how far the routing is from a near-tie that rounding could flip."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(args[0] @ mod.weight.T))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    experts, kept = model.config.num_experts, model.config.num_experts_per_tok
    ranked = torch.cat([s.reshape(-1, experts) for s in seen]).sort(dim=-1, descending=True).values
    return float((ranked[:, kept - 1] - ranked[:, kept]).min())

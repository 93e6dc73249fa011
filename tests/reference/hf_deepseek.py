"""Tiny random Hugging Face DeepSeek-V2 / V3 models, their weights under GGUF names as llama.cpp's converter
writes them, and their routers' choice margins.

The converter splits each layer's `kv_b_proj` (heads * (nope + vdim), kv_lora) into `attn_k_b`, each head's
key half transposed (heads, kv_lora, nope), and `attn_v_b` (heads, vdim, kv_lora); the experts' `gate_up_proj`
into `ffn_gate_exps` and `ffn_up_exps`; V3's `e_score_correction_bias` becomes `exp_probs_b.bias`.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from fuselane.gguf.synth_latent import LatentShape
from tests.reference.hf_tiny import HF_TO_GGUF, randomize

EXPERTS, KEPT, EXPERT_FF = 8, 2, 32
KV_LORA, NOPE, ROPE, VDIM, Q_LORA = 32, 16, 16, 24, 48
ROUTER_SCALE = 0.5  # router weights spread the scores, so kept and dropped experts are well apart
BIAS_SCALE = 0.05  # V3's correction bias: about the spread of sigmoid scores, so it changes some choices
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
GROUPS, GROUPS_USED, SCALE = 4, 2, 2.5

LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def tiny_deepseek(version: int, *, q_lora: bool | int, seed: int = 0, layers: int = 3, **widths):
    """A random tiny DeepSeek-V2 (softmax routing, its weights scaled, not renormalised) or V3 (sigmoid routing
    with a correction bias, grouped top-k, renormalised and scaled, YaRN), with or without q LoRA (`q_lora`: a
    rank, or True for the default's). `widths` overrides the config's other fields (heads, the latent's and the
    heads' widths, the experts, the groups)."""
    torch.manual_seed(seed)
    rank = Q_LORA if q_lora is True else (q_lora or None)
    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=EXPERT_FF,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=KEPT, q_lora_rank=rank,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM,
        first_k_dense_replace=1, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
        routed_scaling_factor=SCALE,
    ) | widths  # fmt: skip
    common["num_key_value_heads"] = common["num_attention_heads"]
    if version == 2:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**common))
    else:
        grouping = {"n_group": GROUPS, "topk_group": GROUPS_USED} | common
        model = DeepseekV3ForCausalLM(DeepseekV3Config(norm_topk_prob=True, rope_scaling=dict(YARN), **grouping))
    model = randomize(model, {"mlp.gate.weight": ROUTER_SCALE})
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(BIAS_SCALE * torch.randn(bias.shape))
    return model


def latent_shape(model, version: int) -> LatentShape:
    """The synthetic writer's shape of a tiny DeepSeek model."""
    c = model.config
    v3 = version == 3
    return LatentShape(
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size,
        kv_lora=c.kv_lora_rank, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim, vdim=c.v_head_dim,
        q_lora=c.q_lora_rank or 0, dense_layers=c.first_k_dense_replace, experts=c.n_routed_experts,
        experts_used=c.num_experts_per_tok, expert_ff=c.moe_intermediate_size, shared_experts=c.n_shared_experts or 0,
        weights_scale=c.routed_scaling_factor, weights_norm=v3, sigmoid=v3, groups=c.n_group if v3 else 1,
        groups_used=c.topk_group if v3 else 1, yarn_factor=YARN["factor"] if v3 else 1.0,
        yarn_original=YARN["original_max_position_embeddings"], context=c.max_position_embeddings,
        rope_base=c.rope_parameters["rope_theta"], rms_eps=c.rms_norm_eps,
    )  # fmt: skip


def latent_weights(model) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF tensor names, in numpy order, split as the converter splits them."""
    c, out = model.config, {}
    for name, p in model.state_dict().items():
        value = p.detach().cpu().numpy().astype(np.float32)
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = value
            continue
        layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        b = f"blk.{layer}."
        if rest == "self_attn.kv_b_proj.weight":
            kv_b = value.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            out[b + "attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1))
            out[b + "attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, c.qk_nope_head_dim :])
        elif rest == "mlp.experts.gate_up_proj":
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = np.split(value, 2, axis=1)
        else:
            out[b + LAYER_TO_GGUF[rest]] = value
    return out


def choice_margins(model, ids: list[int]) -> float:
    """The smallest margin, over every row and mixture layer of a forward pass of `ids`, by which a kept
    expert's choice score (and, grouped, a kept group's score) leads the best one left out: how far the
    routing is from a near-tie that rounding could flip."""
    margins: list[float] = []

    def seen(gate, args, out) -> None:
        _, _, kept = out
        logits = args[0].reshape(-1, gate.weight.shape[1]).float() @ gate.weight.T
        bias = getattr(gate, "e_score_correction_bias", None)
        choice = logits.sigmoid() + bias if bias is not None else logits  # a softmax ranks as its scores do
        if bias is not None and gate.num_group > 1:
            groups = choice.view(len(choice), gate.num_group, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, True)[0]
            margins.append(float((groups[:, gate.topk_group - 1] - groups[:, gate.topk_group]).min()))
        ranked = torch.gather(choice, 1, kept).min(-1)[0]
        left = choice.scatter(1, kept, -torch.inf)
        margins.append(float((ranked - _best_in_kept_groups(gate, choice, left)).min()))

    hooks = [layer.mlp.gate.register_forward_hook(seen) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return min(margins)


def _best_in_kept_groups(gate, choice, left):
    """The best choice score left out among the experts of the row's kept groups (every expert's, ungrouped)."""
    if getattr(gate, "e_score_correction_bias", None) is None or gate.num_group == 1:
        return left.max(-1)[0]
    groups = gate.num_group
    scores = choice.view(len(choice), groups, -1).topk(2, dim=-1)[0].sum(-1)
    kept = scores.topk(gate.topk_group, dim=-1)[1]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter(1, kept, True)
    mask = mask.repeat_interleave(choice.shape[1] // groups, dim=1)
    return torch.where(mask, left, -torch.inf).max(-1)[0]

"""Tiny random Hugging Face Qwen2/Qwen3 models and their weights under GGUF names, for logits comparisons."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fuselane.gguf.synth import Shape

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_hf(arch: str, *, seed: int = 0, layers: int = 2, tied: bool = False, yarn: tuple[float, int] | None = None,
            hidden: int = 64, ff: int = 96, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
            rope_theta: float = 1e6, eps: float = 1e-6):  # fmt: skip
    """A random tiny model of `arch` whose norms and biases are random too (HF starts them at 1 and 0); `yarn`
    (factor, original context) stretches its rotary frequencies by YaRN. Qwen2's heads are `hidden / heads`
    wide (its config has no head width); Qwen3's `head_dim`."""
    torch.manual_seed(seed)
    rope: dict = {"rope_theta": rope_theta}
    if yarn is not None:
        rope |= {"rope_type": "yarn", "factor": yarn[0], "original_max_position_embeddings": yarn[1]}
    common = dict(
        vocab_size=384,
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=eps,
        max_position_embeddings=512,
        rope_parameters=rope,
        tie_word_embeddings=tied,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    return randomize(model)


def randomize(model, spreads: dict[str, float] | None = None):
    """`model` with random weights that keep activations in range: norm weights 1 +- 0.2, biases 0.2, every
    other parameter 0.08, or the spread `spreads` gives parameters whose names end with its keys. Returns it in
    f32, in eval mode."""
    spreads = spreads or {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = next((v for k, v in spreads.items() if name.endswith(k)), None)
            if spread is not None:
                p.copy_(spread * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval().float()


def shape_of(model, arch: str, **fields) -> Shape:
    """The synthetic writer's Shape of a tiny Hugging Face model; `fields` adds what the config's dense reading
    leaves out (a mixture's experts)."""
    c = model.config
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        fields = dict(yarn_factor=rope["factor"], yarn_original=rope["original_max_position_embeddings"]) | fields
    return Shape(
        arch=arch,
        n_embd=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        n_ff=c.intermediate_size,
        vocab=c.vocab_size,
        context=c.max_position_embeddings,
        rope_base=c.rope_parameters["rope_theta"],
        rms_eps=c.rms_norm_eps,
        tied=c.tie_word_embeddings,
        **fields,
    )


def gguf_weights(model) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF tensor names (numpy order; no q/k permutation for Qwen)."""
    out = {}
    for name, p in model.state_dict().items():
        if name in HF_TO_GGUF:
            key = HF_TO_GGUF[name]
        else:
            prefix, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            key = f"blk.{prefix}.{LAYER_TO_GGUF[rest]}"
        if key == "output.weight" and model.config.tie_word_embeddings:
            continue
        out[key] = p.detach().cpu().numpy().astype(np.float32)
    return out


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """`prompt` on one of our models' sessions, then `steps` greedy steps: the ids (the prompt and the picks)
    and each step's logits, for a reference's pass over the same ids."""
    session = model.session()
    ids = list(prompt)
    ours = [session.feed(ids)]
    for _ in range(steps):
        ids.append(int(np.argmax(ours[-1])))
        ours.append(session.extend(ids[-1:]))
    return ids, ours


def greedy_from(path, prompt: list[int], steps: int, ctx: int = 64) -> tuple[list[int], list[np.ndarray]]:
    """`greedy` on the cpu lane's model of the file at `path`, loaded for it and closed after."""
    from fuselane.runtime.model import load

    model = load(path, lane="cpu", ctx=ctx)
    try:
        return greedy(model, prompt, steps)
    finally:
        model.close()

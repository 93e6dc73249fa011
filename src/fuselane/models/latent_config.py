"""Hyper-parameters of a DeepSeek model (`deepseek2`: DeepSeek-V2, V2-Lite, V3), read from GGUF metadata as
llama.cpp's converter writes it, and checked against the tensors.

The file is MLA-shaped: `attention.key_length` / `value_length` are the absorbed sizes (the latent plus the
rotated key, the latent) and the per-head sizes are `key_length_mla` / `value_length_mla`. Where the file
leaves a choice open this follows llama.cpp: the query is plain (`attn_q`) unless the file holds the q LoRA
tensors; routing is a softmax unless `expert_gating_func` says sigmoid; experts are grouped V3's way. Every
count is checked before anything is sized by it, and a wrong one is a one-line `ModelError` naming the key.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuselane.errors import ModelError
from fuselane.graph.ops import Gating, Yarn
from fuselane.models.config import (
    DEFAULT_RMS_EPS,
    DEFAULT_ROPE_BASE,
    MAX_CONTEXT,
    ModelConfig,
    found,
    get_key,
    layers_present,
    read_stretch,
)

ARCH = "deepseek2"


class GatingFunc(enum.IntEnum):
    """`expert_gating_func` as llama.cpp numbers it."""

    SOFTMAX = 1
    SIGMOID = 2


GATINGS = {GatingFunc.SOFTMAX: Gating.SOFTMAX, GatingFunc.SIGMOID: Gating.SIGMOID}
GROUP_BEST = 2  # a group scores its two best experts, so a group has at least two


@dataclass(frozen=True, slots=True)
class LatentConfig:
    """What a deepseek2 layer needs beyond a mixture's fields."""

    q_lora: int  # the query's LoRA rank (0: a plain query product)
    kv_lora: int  # the latent's width: one latent row a token in the cache
    nope: int  # each head's unrotated query/key values
    rope: int  # each head's rotated values (the key's shared by every head)
    vdim: int  # each head's value width
    dense_layers: int  # the leading layers with a dense feed-forward
    shared_experts: int  # shared experts, run as one SwiGLU `shared_experts * expert_ff` wide
    gating: Gating
    bias: bool  # a per-expert correction bias on the choice scores (`exp_probs_b`)
    weights_scale: float  # the kept weights' scale
    groups: int  # expert groups (1: none)
    groups_used: int
    yarn: Yarn | None
    attn_scale: float  # the attention's scale: YaRN's mscale squared over sqrt(nope + rope)

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @property
    def cache_width(self) -> int:
        """A cache row: the latent, then the shared rotated key."""
        return self.kv_lora + self.rope


def _opt(meta: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    return get_key(meta, key, kind, default) if key in meta else default


def _count(meta: Mapping[str, Any], key: str) -> int:
    """A count that may be zero (absent: zero)."""
    value = meta.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelError(f"metadata key '{key}' should be a count, found {found(value)}")
    return value


def _flag(meta: Mapping[str, Any], key: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise ModelError(f"metadata key '{key}' should be a BOOL, found {found(value)}")
    return value


def _head_sizes(meta: Mapping[str, Any], p: str, kv_lora: int) -> tuple[int, int, int]:
    """(nope, rope, vdim) from the per-head keys, checked against the absorbed sizes where the file states them."""
    rope = get_key(meta, p + "rope.dimension_count", int)
    qk = get_key(meta, p + "attention.key_length_mla", int, meta.get(p + "attention.key_length"))
    vdim = get_key(meta, p + "attention.value_length_mla", int, meta.get(p + "attention.value_length"))
    if rope % 2:
        raise ModelError(f"metadata key '{p}rope.dimension_count' is {rope}, odd; rope rotates pairs of values")
    if qk <= rope:
        raise ModelError(f"a head's key length {qk} leaves no unrotated values beside {rope} rotated ones")
    if p + "attention.key_length_mla" in meta:  # an MLA-shaped file: its plain sizes are the absorbed ones
        for key, want in (("key_length", kv_lora + rope), ("value_length", kv_lora)):
            found = _opt(meta, p + "attention." + key, int, want)
            if found != want:
                raise ModelError(f"metadata key '{p}attention.{key}' says {found:,}; the latent implies {want:,}")
    return qk - rope, rope, vdim


def _yarn(meta: Mapping[str, Any], p: str, qk: int) -> tuple[Yarn | None, float]:
    """YaRN's stretch where the file asks for it, and the attention's scale (its mscale squared, as llama.cpp)."""
    kind = meta.get(p + "rope.scaling.type", "none")
    if kind == "none":
        return None, 1.0 / math.sqrt(qk)
    if kind != "yarn":
        raise ModelError(f"metadata key '{p}rope.scaling.type' is {found(kind)}; deepseek2 runs none or yarn")
    s = p + "rope.scaling."
    yarn = read_stretch(meta, s, None)
    log_mul = _opt(meta, s + "yarn_log_multiplier", float, 0.0)
    mscale = 1.0 + log_mul * math.log(yarn.factor)
    return yarn, mscale * mscale / math.sqrt(qk)


def _routing(meta: Mapping[str, Any], tensors: Mapping[str, Any], p: str, experts: int, used: int) -> dict:
    func = _opt(meta, p + "expert_gating_func", int, GatingFunc.SOFTMAX)
    if func not in GATINGS.keys():
        raise ModelError(f"metadata key '{p}expert_gating_func' is {func}; llama.cpp knows 1 (softmax), 2 (sigmoid)")
    groups = _opt(meta, p + "expert_group_count", int, 1)
    groups_used = _opt(meta, p + "expert_group_used_count", int, groups)
    if experts % groups or (groups > 1 and experts // groups < GROUP_BEST):
        raise ModelError(
            f"metadata key '{p}expert_group_count' says {groups:,} groups; {experts:,} experts do not "
            f"split into groups of at least {GROUP_BEST}"
        )
    if groups_used > groups or used > groups_used * (experts // groups):
        raise ModelError(
            f"metadata key '{p}expert_group_used_count' says {groups_used:,} groups of {groups:,}, "
            f"too few for {used:,} experts a token"
        )
    return {
        "gating": GATINGS[GatingFunc(func)],
        "bias": any(name.endswith("exp_probs_b.bias") for name in tensors),
        "weights_scale": _opt(meta, p + "expert_weights_scale", float, 1.0),
        "groups": groups,
        "groups_used": groups_used,
    }


def _q_lora(meta: Mapping[str, Any], tensors: Mapping[str, Any], p: str) -> int:
    """The query's LoRA rank: the tensors decide (llama.cpp guesses from the layer count where the key is absent)."""
    key = p + "attention.q_lora_rank"
    if "blk.0.attn_q.weight" in tensors:
        return 0
    if "blk.0.attn_q_a.weight" not in tensors:
        raise ModelError("tensor 'blk.0.attn_q.weight' is missing (nor does the file hold the q LoRA 'attn_q_a')")
    return get_key(meta, key, int, tensors["blk.0.attn_q_a.weight"].shape[0])


def read_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], arch: str = ARCH) -> ModelConfig:
    """A deepseek2 config from metadata, checked against the tensors' presence (`check_weights` checks shapes)."""
    p = f"{arch}."
    n_embd = get_key(meta, p + "embedding_length", int)
    n_heads = get_key(meta, p + "attention.head_count", int)
    n_layers = get_key(meta, p + "block_count", int)
    present = layers_present(tensors)
    if n_layers > present:
        raise ModelError(
            f"metadata key '{p}block_count' says {n_layers:,} layers but the file holds tensors for {present:,}"
        )
    if "token_embd.weight" not in tensors:
        raise ModelError("tensor 'token_embd.weight' is missing")
    vocab = tensors["token_embd.weight"].shape[0]
    if p + "vocab_size" in meta and get_key(meta, p + "vocab_size", int) != vocab:
        raise ModelError(
            f"metadata key '{p}vocab_size' says {meta[p + 'vocab_size']:,} tokens but "
            f"token_embd.weight has {vocab:,} rows"
        )
    context = get_key(meta, p + "context_length", int)
    if context > MAX_CONTEXT:
        raise ModelError(f"metadata key '{p}context_length' is {context:,}, past the {MAX_CONTEXT:,} positions")
    kv_lora = get_key(meta, p + "attention.kv_lora_rank", int)
    nope, rope, vdim = _head_sizes(meta, p, kv_lora)
    dense = _count(meta, p + "leading_dense_block_count")
    if dense > n_layers:
        raise ModelError(f"metadata key '{p}leading_dense_block_count' says {dense:,} dense layers of {n_layers:,}")
    experts = used = expert_ff = shared = 0
    routing: dict[str, Any] = {
        "gating": Gating.SOFTMAX,
        "bias": False,
        "weights_scale": 1.0,
        "groups": 1,
        "groups_used": 1,
    }
    if dense < n_layers:  # a mixture past the dense layers
        experts = get_key(meta, p + "expert_count", int)
        used = get_key(meta, p + "expert_used_count", int)
        if used > experts:
            raise ModelError(
                f"metadata key '{p}expert_used_count' says {used:,} experts a token, more than the "
                f"{experts:,} of '{p}expert_count'"
            )
        expert_ff = get_key(meta, p + "expert_feed_forward_length", int)
        shared = _count(meta, p + "expert_shared_count")
        routing = _routing(meta, tensors, p, experts, used)
    yarn, attn_scale = _yarn(meta, p, nope + rope)
    rope_base = get_key(meta, p + "rope.freq_base", float, DEFAULT_ROPE_BASE)
    rms_eps = get_key(meta, p + "attention.layer_norm_rms_epsilon", float, DEFAULT_RMS_EPS)
    if rope_base <= 0 or rms_eps < 0:
        raise ModelError(
            f"metadata keys '{p}rope.freq_base' {rope_base} / '{p}attention.layer_norm_rms_epsilon' "
            f"{rms_eps} are out of range"
        )
    latent = LatentConfig(
        q_lora=_q_lora(meta, tensors, p),
        kv_lora=kv_lora,
        nope=nope,
        rope=rope,
        vdim=vdim,
        dense_layers=dense,
        shared_experts=shared,
        yarn=yarn,
        attn_scale=attn_scale,
        **routing,
    )
    # the dense layers' width; a file of mixture layers alone may omit it
    n_ff = get_key(meta, p + "feed_forward_length", int, None if dense else expert_ff)
    return ModelConfig(
        arch=arch,
        n_embd=n_embd,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=1,  # one latent row a token, shared by every head
        head_dim=nope + rope,
        n_ff=n_ff,
        vocab=vocab,
        context=context,
        rope_base=rope_base,
        rms_eps=rms_eps,
        tied="output.weight" not in tensors,
        qkv_bias=False,
        qk_norm=False,
        experts=experts,
        experts_used=used,
        expert_ff=expert_ff,
        shared_ff=shared * expert_ff,
        renorm=_flag(meta, p + "expert_weights_norm"),
        latent=latent,
    )

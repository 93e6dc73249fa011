"""Hyper-parameters of a Qwen-family model (dense, or a mixture of experts), read from GGUF metadata and checked
against its tensors.

Every count here is a claim the file makes, and later code sizes tables and loops by it (the recognizer lists
`block_count` layers of weights before comparing any of them), so each is checked before it is returned:
the layer count against the layers whose tensors the file actually holds, the context against the positions
a model can address, the rest against their kind and sign. A wrong value is a one-line `ModelError` naming
the key, what was expected and what was found.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fuselane.errors import ModelError
from fuselane.graph.ops import Yarn

DEFAULT_RMS_EPS = 1e-6
DEFAULT_ROPE_BASE = 10_000.0
# ggml numbers positions with int32, so no model addresses more; real contexts are far below (10M at most).
MAX_CONTEXT = 2**31 - 1
_LAYER_NAME = re.compile(r"blk\.(\d+)\.")
# Whether a mixture renormalises its top-k routing probabilities over the k kept: the file does not say, so
# this follows llama.cpp, which hardcodes it per architecture (and Hugging Face's configs, which agree).
RENORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "qwen3next": True}
# YaRN as llama.cpp reads it for the Qwen family: betas where the file states none, and the rotation's cos and sin
# scaled by 1 + YARN_MSCALE_LOG * ln(factor) (ggml's rope_yarn; Hugging Face's default `attention_factor`).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
YARN_MSCALE_LOG = 0.1
ROPE_SCALINGS = ("none", "yarn")
# Where the mixture's shared expert is: qwen2moe and qwen3next have one, gated by a sigmoid; qwen3moe has none.
SHARED_EXPERT = {"qwen2moe": True, "qwen3moe": False, "qwen3next": True}


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """A hybrid model's linear-attention (gated delta rule) layers: which layers they are, their key and value
    heads, and their convolution's taps (read by `models.qwen3next_config`)."""

    layers: tuple[bool, ...]  # per layer: True where it is a gated delta-rule layer, False for full attention
    k_heads: int
    v_heads: int
    k_dim: int  # a key (and query) head's width
    v_dim: int  # a value head's width
    conv: int  # the causal convolution's taps

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_width(self) -> int:
        """The convolution's channels: the queries, keys and values of a row."""
        return 2 * self.key_width + self.value_width


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    n_embd: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    vocab: int
    context: int
    rope_base: float
    rms_eps: float
    tied: bool  # the output projection is the embedding table
    qkv_bias: bool  # qwen2: q, k and v products add a bias
    qk_norm: bool  # qwen3: per-head RMS norm of q and k before rope
    experts: int = 0  # a mixture's experts (0: a dense model)
    experts_used: int = 0  # experts kept a row (top-k)
    expert_ff: int = 0  # each expert's hidden width
    shared_ff: int = 0  # the shared expert's hidden width (0: none)
    renorm: bool = False  # the kept experts' probabilities are renormalised to sum to one
    rope_dim: int = 0  # values of a head that rope turns (0: all of head_dim)
    linear: LinearAttention | None = None  # a hybrid's gated delta-rule layers (qwen3next)
    latent: Any = None  # deepseek2's latent attention and routing (`models.latent_config.LatentConfig`)
    yarn: Yarn | None = None  # YaRN's stretch of the rotary frequencies (`rope.scaling.type` yarn)
    # what the attention's scores are multiplied by beyond 1/sqrt(head_dim): YaRN's cos and sin scale, squared
    # (a query's and a key's rotation each carry it; every value of a head turns)
    score_scale: float = 1.0
    shard: Any = None  # tensor parallel: which rank of how many, its rows and experts (`parallel.shard.Shard`)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def cache_values(self) -> int:
        """Values the cache holds a token a layer: a key and a value row of every kv head, or (latent
        attention) one latent row and its shared rotated key."""
        return self.latent.cache_width if self.latent is not None else 2 * self.kv_width

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


def found(value: Any) -> str:
    """A metadata value's kind and (short) value, as an error message names what it found."""
    if isinstance(value, bool):
        kind = "a BOOL"
    elif isinstance(value, int):
        kind = "an integer"
    elif isinstance(value, float):
        kind = "a float"
    elif isinstance(value, str):
        kind = "a STRING"
    elif isinstance(value, list):
        return f"an ARRAY of {len(value):,} values"
    else:
        kind = type(value).__name__
    shown = repr(value)
    return f"{kind} ({shown[:40]}...)" if len(shown) > 40 else f"{kind} ({shown})"


def get_key(meta: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ModelError(f"metadata key '{key}' is missing")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelError(f"metadata key '{key}' should be an integer, found {found(value)}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ModelError(f"metadata key '{key}' should be a number, found {found(value)}")
    if kind is int and value <= 0:
        raise ModelError(f"metadata key '{key}' should be positive, not {value:,}")
    if kind is float and not math.isfinite(value):
        raise ModelError(f"metadata key '{key}' should be a finite number, not {value}")
    return kind(value)


def layers_present(tensors: Mapping[str, Any]) -> int:
    """How many layers (`blk.<i>.` prefixes) the file holds tensors for: the bound on `block_count`."""
    return len({m.group(1) for name in tensors if (m := _LAYER_NAME.match(name))})


def _check_counts(meta: Mapping[str, Any], tensors: Mapping[str, Any], p: str, n_layers: int, vocab: int) -> None:
    """Refuse counts that disagree with the tensors present before anything is sized by them."""
    present = layers_present(tensors)
    if n_layers > present:
        raise ModelError(
            f"metadata key '{p}block_count' says {n_layers:,} layers but the file holds tensors for {present:,}"
        )
    claimed_vocab = meta.get(p + "vocab_size")
    if claimed_vocab is not None and get_key(meta, p + "vocab_size", int) != vocab:
        raise ModelError(
            f"metadata key '{p}vocab_size' says {claimed_vocab:,} tokens but token_embd.weight has {vocab:,} rows"
        )
    if (
        p[:-1] not in RENORM_TOPK
        and meta.get(p + "expert_count") is not None
        and get_key(meta, p + "expert_count", int)
    ):
        raise ModelError(
            f"metadata key '{p}expert_count' declares {meta[p + 'expert_count']:,} experts, but {p[:-1]} is a dense "
            f"architecture (mixtures are {' / '.join(RENORM_TOPK)})"
        )


def _shared_width(meta: Mapping[str, Any], tensors: Mapping[str, Any], p: str) -> int:
    """The shared expert's hidden width: its key, or (older files omit it) its up product's rows."""
    key = p + "expert_shared_feed_forward_length"
    if key in meta:
        return get_key(meta, key, int)
    up = tensors.get("blk.0.ffn_up_shexp.weight")
    if up is None:
        raise ModelError(f"metadata key '{key}' is missing")
    return int(up.shape[0])


def read_experts(meta: Mapping[str, Any], tensors: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A mixture's counts and widths (ModelConfig's expert fields); empty for a dense architecture."""
    if arch not in RENORM_TOPK:
        return {}
    p = f"{arch}."
    experts = get_key(meta, p + "expert_count", int)
    used = get_key(meta, p + "expert_used_count", int)
    if used > experts:
        raise ModelError(
            f"metadata key '{p}expert_used_count' says {used:,} experts a token, more than the {experts:,} of "
            f"'{p}expert_count'"
        )
    shared = _shared_width(meta, tensors, p) if SHARED_EXPERT[arch] else 0
    return {
        "experts": experts,
        "experts_used": used,
        "expert_ff": get_key(meta, p + "expert_feed_forward_length", int),
        "shared_ff": shared,
        "renorm": RENORM_TOPK[arch],
    }


# reads an architecture's own fields: (meta, tensors, key prefix, layers, head size) -> ModelConfig fields
ExtraFields = Callable[[Mapping[str, Any], Mapping[str, Any], str, int, int], dict[str, Any]]


def read_config(
    meta: Mapping[str, Any], tensors: Mapping[str, Any], arch: str, extra: ExtraFields | None = None
) -> ModelConfig:
    """A Qwen2/Qwen3 (or their mixtures') config from metadata; `tensors` (name -> object with `.shape`) settle
    what metadata omits. `extra` reads an architecture's own fields (qwen3next's hybrid layers)."""
    p = f"{arch}."
    n_embd = get_key(meta, p + "embedding_length", int)
    n_heads = get_key(meta, p + "attention.head_count", int)
    n_kv = get_key(meta, p + "attention.head_count_kv", int, n_heads)
    if n_heads % n_kv:
        raise ModelError(f"{n_heads:,} attention heads do not group evenly over {n_kv:,} key/value heads")
    if p + "attention.key_length" not in meta and n_heads > n_embd:
        raise ModelError(
            f"metadata key '{p}attention.head_count' says {n_heads:,} heads, more than the {n_embd:,} values "
            f"of '{p}embedding_length' can be split into"
        )
    head_dim = get_key(meta, p + "attention.key_length", int, n_embd // n_heads)
    if head_dim % 2:  # refused here, by name, rather than failing deep inside the rope kernel
        raise ModelError(f"the head size {head_dim} is odd; rope rotates pairs of values")
    value_dim = get_key(meta, p + "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise ModelError(f"key length {head_dim} and value length {value_dim} differ; fuselane needs them equal")
    if "token_embd.weight" not in tensors:
        raise ModelError("tensor 'token_embd.weight' is missing")
    vocab = tensors["token_embd.weight"].shape[0]
    n_layers = get_key(meta, p + "block_count", int)
    _check_counts(meta, tensors, p, n_layers, vocab)
    context = get_key(meta, p + "context_length", int)
    if context > MAX_CONTEXT:
        raise ModelError(
            f"metadata key '{p}context_length' is {context:,}, past the {MAX_CONTEXT:,} positions a model can address"
        )
    rope_base = get_key(meta, p + "rope.freq_base", float, DEFAULT_ROPE_BASE)
    if rope_base <= 0:
        raise ModelError(f"metadata key '{p}rope.freq_base' should be positive, not {rope_base}")
    experts = read_experts(meta, tensors, arch)
    if extra is not None:
        experts |= extra(meta, tensors, p, n_layers, head_dim)
    yarn, mscale = read_yarn(meta, p, head_dim, experts.get("rope_dim", 0), context)
    # a mixture's files state the dense width too (unused); one that omits it needs none
    n_ff = get_key(meta, p + "feed_forward_length", int, experts.get("expert_ff"))
    rms_eps = get_key(meta, p + "attention.layer_norm_rms_epsilon", float, DEFAULT_RMS_EPS)
    if rms_eps < 0:
        raise ModelError(f"metadata key '{p}attention.layer_norm_rms_epsilon' should not be negative, not {rms_eps}")
    return ModelConfig(
        arch=arch,
        n_embd=n_embd,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        vocab=vocab,
        context=context,
        rope_base=rope_base,
        rms_eps=rms_eps,
        tied="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        # qwen3next's full-attention layers always norm q and k (its layer 0 is usually a linear one)
        qk_norm=arch == "qwen3next" or "blk.0.attn_q_norm.weight" in tensors,
        yarn=yarn,
        score_scale=mscale * mscale,
        **experts,
    )


def read_yarn(meta: Mapping[str, Any], p: str, head_dim: int, rope_dim: int, context: int) -> tuple[Yarn | None, float]:
    """YaRN's stretch where `rope.scaling.type` asks for it (None otherwise), and the scale of the rotation's cos
    and sin: llama.cpp's and Hugging Face's reading of a Qwen file's `rope.scaling.*` keys. The original context
    defaults to the model's (llama.cpp's default)."""
    kind = meta.get(p + "rope.scaling.type", "none")
    if kind not in ROPE_SCALINGS:
        raise ModelError(f"metadata key '{p}rope.scaling.type' is {found(kind)}; fuselane runs none or yarn")
    if kind == "none":
        return None, 1.0
    s = p + "rope.scaling."
    yarn = read_stretch(meta, s, context)
    if rope_dim and rope_dim != head_dim:
        raise ModelError(
            f"YaRN scales a rotation's cos and sin, and rope turns {rope_dim} of a head's {head_dim} values: "
            "fuselane runs YaRN on whole heads only"
        )
    attn_factor = get_key(meta, s + "attn_factor", float, 1.0)  # finite: `get_key`'s check
    if attn_factor <= 0:
        raise ModelError(f"metadata key '{s}attn_factor' should be positive, not {attn_factor}")
    return yarn, attn_factor * (1.0 + YARN_MSCALE_LOG * math.log(yarn.factor))


def read_stretch(meta: Mapping[str, Any], s: str, original: int | None) -> Yarn:
    """YaRN's stretch from the `rope.scaling.` keys under `s` (every architecture's): the factor, the original
    context (`original` where the file states none; required where that is None) and the betas (llama.cpp's
    defaults where absent); a factor below 1 or betas that cross describe no stretch and are refused."""
    yarn = Yarn(
        factor=get_key(meta, s + "factor", float),
        original=get_key(meta, s + "original_context_length", int, original),
        beta_fast=get_key(meta, s + "yarn_beta_fast", float, YARN_BETA_FAST),
        beta_slow=get_key(meta, s + "yarn_beta_slow", float, YARN_BETA_SLOW),
    )
    if yarn.factor < 1 or yarn.beta_fast <= yarn.beta_slow:
        raise ModelError(
            f"metadata keys '{s}*' describe no stretch: factor {yarn.factor}, betas {yarn.beta_fast}, {yarn.beta_slow}"
        )
    return yarn

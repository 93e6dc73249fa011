"""Hyper-parameters of a dense Qwen-family model, read from GGUF metadata and checked against its tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuselane.errors import ModelError

DEFAULT_RMS_EPS = 1e-6
DEFAULT_ROPE_BASE = 10_000.0


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

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


def _get(meta: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ModelError(f"metadata key '{key}' is missing")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelError(f"metadata key '{key}' should be an integer, not {value!r}")
    if kind is float and not isinstance(value, int | float):
        raise ModelError(f"metadata key '{key}' should be a number, not {value!r}")
    if kind is int and value <= 0:
        raise ModelError(f"metadata key '{key}' should be positive, not {value}")
    return kind(value)


def read_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], arch: str) -> ModelConfig:
    """A Qwen2/Qwen3 config from metadata; `tensors` (name -> object with `.shape`) settle what metadata omits."""
    p = f"{arch}."
    n_embd = _get(meta, p + "embedding_length", int)
    n_heads = _get(meta, p + "attention.head_count", int)
    n_kv = _get(meta, p + "attention.head_count_kv", int, n_heads)
    if n_heads % n_kv:
        raise ModelError(f"{n_heads} attention heads do not group evenly over {n_kv} key/value heads")
    head_dim = _get(meta, p + "attention.key_length", int, n_embd // n_heads)
    if head_dim % 2:  # refused here, by name, rather than failing deep inside the rope kernel
        raise ModelError(f"the head size {head_dim} is odd; rope rotates pairs of values")
    value_dim = _get(meta, p + "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise ModelError(f"key length {head_dim} and value length {value_dim} differ; fuselane needs them equal")
    if "token_embd.weight" not in tensors:
        raise ModelError("tensor 'token_embd.weight' is missing")
    vocab = tensors["token_embd.weight"].shape[0]
    return ModelConfig(
        arch=arch,
        n_embd=n_embd,
        n_layers=_get(meta, p + "block_count", int),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_ff=_get(meta, p + "feed_forward_length", int),
        vocab=vocab,
        context=_get(meta, p + "context_length", int),
        rope_base=_get(meta, p + "rope.freq_base", float, DEFAULT_ROPE_BASE),
        rms_eps=_get(meta, p + "attention.layer_norm_rms_epsilon", float, DEFAULT_RMS_EPS),
        tied="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )

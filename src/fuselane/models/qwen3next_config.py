"""Qwen3-Next's hybrid hyper-parameters: which layers are gated delta-rule (linear-attention) layers, their
heads and widths, the convolution's taps and the full-attention layers' partial rotary.

Read as llama.cpp reads them: `attention.recurrent_layers` (one flag a layer) where the file has it, else
every `full_attention_interval`-th layer (default 4) is full attention and the others linear; the linear
layers' key heads are `ssm.group_count`, value heads `ssm.time_step_rank`, both `ssm.state_size` wide (the
value width is also `ssm.inner_size` / value heads, which must agree: llama.cpp requires the key and value
head widths equal). Each count is checked before anything is sized by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.models.config import LinearAttention, found, get_key

DEFAULT_FULL_INTERVAL = 4  # llama.cpp's default when the file names neither the interval nor the layers


def _layer_kinds(meta: Mapping[str, Any], p: str, n_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it is a linear (gated delta-rule) layer."""
    key = p + "attention.recurrent_layers"
    if key in meta:
        flags = meta[key]
        if not isinstance(flags, list) or any(not isinstance(f, bool | int) for f in flags):
            raise ModelError(f"metadata key '{key}' should be an array of one flag a layer, found {found(flags)}")
        if len(flags) < n_layers:
            raise ModelError(f"metadata key '{key}' flags {len(flags):,} layers, fewer than the {n_layers:,} layers")
        return tuple(bool(f) for f in flags[:n_layers])
    every = get_key(meta, p + "full_attention_interval", int, DEFAULT_FULL_INTERVAL)
    return tuple((i + 1) % every != 0 for i in range(n_layers))


def read_hybrid(
    meta: Mapping[str, Any], tensors: Mapping[str, Any], p: str, n_layers: int, head_dim: int
) -> dict[str, Any]:
    """ModelConfig's `rope_dim` and `linear` fields of a qwen3next file."""
    rope_dim = get_key(meta, p + "rope.dimension_count", int, head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise ModelError(
            f"metadata key '{p}rope.dimension_count' is {rope_dim:,}: rope turns pairs of at most the head's "
            f"{head_dim:,} values"
        )
    k_heads = get_key(meta, p + "ssm.group_count", int)
    v_heads = get_key(meta, p + "ssm.time_step_rank", int)
    if v_heads % k_heads:
        raise ModelError(
            f"metadata key '{p}ssm.time_step_rank' says {v_heads:,} value heads, which do not group evenly over "
            f"the {k_heads:,} key heads of '{p}ssm.group_count'"
        )
    width = get_key(meta, p + "ssm.state_size", int)
    inner = get_key(meta, p + "ssm.inner_size", int)
    if inner != v_heads * width:
        raise ModelError(
            f"metadata key '{p}ssm.inner_size' is {inner:,}, not the {v_heads:,} value heads of {width:,} values "
            f"the state size implies (key and value heads must be as wide)"
        )
    linear = LinearAttention(
        layers=_layer_kinds(meta, p, n_layers),
        k_heads=k_heads,
        v_heads=v_heads,
        k_dim=width,
        v_dim=width,
        conv=get_key(meta, p + "ssm.conv_kernel", int),
    )
    return {"rope_dim": rope_dim, "linear": linear}

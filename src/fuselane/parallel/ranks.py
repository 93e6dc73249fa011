"""A rank's model: its config (the widths of its slice) and its tensors (slices of the checkpoint's blocks).

What each rank holds, per layer (Megatron's split; the partial sums meet in an all-reduce):
- attention by heads: rows of whole query heads of attn_q and of whole kv heads of attn_k / attn_v (and their
  biases); the per-head q/k norms and the layer norms on every rank; attn_output by the same heads' columns;
- a dense feed-forward by its hidden width: rows of ffn_gate / ffn_up, columns of ffn_down;
- a mixture's experts by whole experts (expert parallel), the router on every rank; a shared expert by its
  hidden width like a dense feed-forward, its gate on every rank;
- the embedding and the output projection by vocabulary rows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.models.config import ModelConfig
from fuselane.parallel.shard import Shard, Span, check_ranks, even, uneven
from fuselane.parallel.slicing import Part, column_refusal, take, whole

_LAYER = re.compile(r"blk\.\d+\.(.+)$")
# per-layer tensor -> (axis, which span of the rank's): rows (0) or columns (-1); the rest are replicated
_CUTS: dict[str, tuple[int, str]] = {
    "attn_q.weight": (0, "q"),
    "attn_q.bias": (0, "q"),
    "attn_k.weight": (0, "kv"),
    "attn_k.bias": (0, "kv"),
    "attn_v.weight": (0, "kv"),
    "attn_v.bias": (0, "kv"),
    "attn_output.weight": (-1, "q"),
    "ffn_gate.weight": (0, "ff"),
    "ffn_up.weight": (0, "ff"),
    "ffn_down.weight": (-1, "ff"),
    "ffn_gate_exps.weight": (0, "experts"),
    "ffn_up_exps.weight": (0, "experts"),
    "ffn_down_exps.weight": (0, "experts"),
    "ffn_gate_shexp.weight": (0, "shared"),
    "ffn_up_shexp.weight": (0, "shared"),
    "ffn_down_shexp.weight": (-1, "shared"),
}
_GLOBAL_CUTS = {"token_embd.weight": (0, "vocab"), "output.weight": (0, "vocab")}


def make_shard(cfg: ModelConfig, tp: int, rank: int) -> Shard:
    """Rank `rank` of `tp`'s vocabulary rows and experts; refuses an architecture the split does not cover."""
    check_ranks(tp, rank)
    if cfg.linear is not None or cfg.latent is not None:
        raise ModelError(f"--tp covers qwen2 / qwen3 and their mixtures, not {cfg.arch}'s layers yet")
    experts = even(cfg.experts, tp, rank, "experts") if cfg.moe else Span(0, 0)
    return Shard(tp, rank, uneven(cfg.vocab, tp, rank), cfg.vocab, experts)


def spans(cfg: ModelConfig, shard: Shard) -> dict[str, Span]:
    """The rank's span of each split axis, in values (heads times their width) or entries."""
    tp, rank, hd = shard.tp, shard.rank, cfg.head_dim
    heads = even(cfg.n_heads, tp, rank, "attention heads")
    kv = even(cfg.n_kv_heads, tp, rank, "key/value heads")
    found = {"q": Span(heads.lo * hd, heads.count * hd), "kv": Span(kv.lo * hd, kv.count * hd)}
    found |= {"vocab": shard.vocab, "experts": shard.experts}
    if not cfg.moe:
        found["ff"] = even(cfg.n_ff, tp, rank, "feed-forward columns")
    if cfg.shared_ff:
        found["shared"] = even(cfg.shared_ff, tp, rank, "shared-expert columns")
    return found


def rank_config(cfg: ModelConfig, tp: int, rank: int) -> ModelConfig:
    """The config of rank `rank`'s graph: its heads and hidden widths, the router's experts and the logits'
    vocabulary whole, and the shard saying which rows and experts it holds. `tp` 1 is the model itself."""
    if tp == 1:
        return cfg
    shard = make_shard(cfg, tp, rank)
    s = spans(cfg, shard)
    hd = cfg.head_dim
    ff = s["ff"].count if "ff" in s else cfg.n_ff
    shared = s["shared"].count if "shared" in s else 0
    return dataclasses.replace(
        cfg, n_heads=s["q"].count // hd, n_kv_heads=s["kv"].count // hd, n_ff=ff, shared_ff=shared, shard=shard
    )


def cut(name: str) -> tuple[int, str] | None:
    """How a tensor of this name is split (axis, span), or None where every rank holds it whole."""
    m = _LAYER.match(name)
    return _CUTS.get(m.group(1)) if m else _GLOBAL_CUTS.get(name)


def rank_shapes(cfg: ModelConfig, tensors: Mapping[str, Any], tp: int, rank: int) -> dict[str, Any]:
    """Rank `rank`'s tensors as shapes and formats only (`explain`'s tables, no bytes), each split checked as
    `rank_tensors` checks it."""
    s = spans(cfg, make_shard(cfg, tp, rank))
    shapes: dict[str, Any] = {}
    for name, t in tensors.items():
        how = cut(name)
        shape = list(t.shape)
        if how is not None:
            axis, span = how
            if axis == -1 and (why := column_refusal(t.format, name, s[span].lo, s[span].count)) is not None:
                raise ModelError(why)
            shape[axis] = s[span].count
        shapes[name] = dataclasses.replace(t, shape=tuple(shape))
    return shapes


def rank_tensors(cfg: ModelConfig, tensors: Mapping[str, Any], tp: int, rank: int) -> dict[str, Part]:
    """Rank `rank`'s tensors by name: its slices, and the replicated ones whole. No block is decoded."""
    if tp == 1:
        return {name: whole(t) for name, t in tensors.items()}
    s = spans(cfg, make_shard(cfg, tp, rank))
    parts: dict[str, Part] = {}
    for name, t in tensors.items():
        how = cut(name)
        if how is None:
            parts[name] = whole(t)
        else:
            axis, span = how
            parts[name] = take(t, axis, s[span].lo, s[span].count)
    return parts

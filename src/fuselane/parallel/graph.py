"""What a rank's graph emits where it differs from the unsplit model's: the all-reduces after the attention
output and the down projection, the embedding of the rank's vocabulary rows made whole, and its logits laid
beside the other ranks'. A builder (`models.qwen.Builder`) calls these only for a config with a shard.
"""

from __future__ import annotations

from typing import Any

from fuselane.graph.ir import Role, Tensor, Values
from fuselane.graph.ops import Matmul
from fuselane.parallel.ops import AllGather, AllReduce, ExpertShard, ShardGather


def reduce(bd: Any, partial: str) -> str:
    """The sum over the ranks of `partial` (rows, cols), as `<partial>.sum`."""
    rows, cols = bd.g.tensors[partial].shape
    out = bd.act(partial + ".sum", cols, rows)
    bd.g.emit(AllReduce(rows, cols), (partial,), out)
    return out


def embed(bd: Any, table: str, ids: str, out: str) -> str:
    """The embedding rows of `ids`: each rank's own tokens' rows, summed over the ranks."""
    shard, d = bd.cfg.shard, bd.cfg.n_embd
    part = bd.act(out + ".part", d)
    bd.g.emit(ShardGather(bd.rows, d, shard.vocab.lo, shard.vocab.count), (table, ids), part)
    bd.g.emit(AllReduce(bd.rows, d), (part,), out)
    return out


def head(bd: Any, h: str, weight: str, out: str) -> None:
    """The logits of `h`: the rank's vocabulary rows' products, gathered beside the other ranks' into `out`."""
    shard, d = bd.cfg.shard, bd.cfg.n_embd
    part = bd.act(out + ".part", shard.vocab.count)
    bd.g.emit(Matmul(bd.rows, shard.vocab.count, d), (h, weight), part)
    bd.g.emit(AllGather(bd.rows, shard.full_vocab, shard.vocab.lo, shard.vocab.count), (part,), out)


def local_route(bd: Any, l_: str, ids: str, weights: str) -> tuple[str, str]:
    """The kept experts' ids and weights as the rank holds its experts (another rank's weighted by zero)."""
    shard, rows, k = bd.cfg.shard, bd.rows, bd.cfg.experts_used
    span = shard.experts
    local = bd.g.add(Tensor(l_ + "experts.local", (rows, k), Values("i32"), Role.ACTIVATION))
    bd.g.emit(ExpertShard(rows, k, span.lo, span.count, weights=False), (ids,), local)
    kept = bd.act(l_ + "route.local", k)
    bd.g.emit(ExpertShard(rows, k, span.lo, span.count, weights=True), (weights, ids), kept)
    return local, kept

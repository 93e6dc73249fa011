"""A rank's graph run in NumPy: the cpu lane's kernels over the rank's slices, the collectives over a
communicator (`torch.distributed`, gloo on CPU processes). It checks the rank logic (the slicing, the graphs
of the slices' widths, where the partial sums meet) against the unsplit cpu lane without a GPU; the cpu lane
itself does not split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fuselane.fuse.shim import NATIVE, Support
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op, TensorGraph
from fuselane.lanes.cpu.lane import CpuLane
from fuselane.lanes.cpu.shim import CpuShim
from fuselane.models.config import ModelConfig
from fuselane.parallel.ops import AllGather, AllReduce, ExpertShard, ShardGather
from fuselane.parallel.ranks import rank_config, rank_tensors


class Communicator(Protocol):
    """Sums an array over the ranks (every rank passes one of the same shape and gets the sum back)."""

    def all_reduce(self, x: np.ndarray) -> np.ndarray: ...


class TorchGroup:
    """The default `torch.distributed` process group as a communicator (the process has joined it)."""

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.ascontiguousarray(x))
        dist.all_reduce(t)
        return t.numpy()


@dataclass(frozen=True, slots=True)
class RankShim(CpuShim):
    """The cpu lane's shim for a rank: it also runs the all-reduce with its residual add and norm as one call."""

    @property
    def name(self) -> str:
        return f"cpu-rank:{np.dtype(self.dtype).name}"

    def supports(self, cls: ClassId) -> Support:
        return NATIVE if cls is ClassId.ALLREDUCE_NORM else CpuShim.supports(self, cls)


def _all_reduce(spec: AllReduce, args: list[np.ndarray], comm: Communicator) -> np.ndarray:
    return comm.all_reduce(args[0].reshape(spec.rows, spec.cols))


def _all_gather(spec: AllGather, args: list[np.ndarray], comm: Communicator) -> np.ndarray:
    placed = np.zeros((spec.rows, spec.cols), dtype=args[0].dtype)  # the ranks' columns do not overlap
    placed[:, spec.lo : spec.lo + spec.width] = args[0].reshape(spec.rows, spec.width)
    return comm.all_reduce(placed)


def _shard_gather(spec: ShardGather, args: list[np.ndarray], comm: Communicator) -> np.ndarray:
    table, ids = args[0], np.asarray(args[1], dtype=np.int64).reshape(-1)
    held = (ids >= spec.lo) & (ids < spec.lo + spec.count)
    out = np.zeros((spec.rows, spec.cols), dtype=table.dtype)
    out[held] = table[ids[held] - spec.lo]
    return out


def _expert_shard(spec: ExpertShard, args: list[np.ndarray], comm: Communicator) -> np.ndarray:
    ids = np.asarray(args[-1], dtype=np.int64).reshape(spec.rows, spec.k)
    held = (ids >= spec.lo) & (ids < spec.lo + spec.count)
    if spec.weights:
        return np.where(held, args[0].reshape(spec.rows, spec.k), 0)
    return np.where(held, ids - spec.lo, 0)


RANK_KERNELS: dict[type, Callable[..., np.ndarray]] = {
    AllReduce: _all_reduce,
    AllGather: _all_gather,
    ShardGather: _shard_gather,
    ExpertShard: _expert_shard,
}


class RankLane(CpuLane):
    """Rank `rank` of `tp`: the cpu lane over the rank's config and slices, its collectives through `comm`."""

    name = "cpu-rank"

    def __init__(
        self, cfg: ModelConfig, tensors: Any, *, tp: int, rank: int, comm: Communicator, ctx: int, dtype: Any
    ) -> None:
        super().__init__(rank_config(cfg, tp, rank), rank_tensors(cfg, tensors, tp, rank), ctx=ctx, dtype=dtype)
        self.shim = RankShim(self.dtype)
        self.comm = comm

    def _step(self, g: TensorGraph, op: Op, env: dict[str, np.ndarray], pos: int) -> None:
        kernel = RANK_KERNELS.get(type(op.sym))
        if kernel is None:
            super()._step(g, op, env, pos)  # a fused op comes back here for each of its parts
            return
        args = [self._value(g, n, env) for n in op.ins]
        self._write(g, op, kernel(op.sym, args, self.comm), env, pos)

"""The cpu lane's paged form: the batch's sequences run one after another, each through its block table.

The KV rows live in one host array per cache tensor, `blocks * block_size` rows each: the pool. The lane's
graphs attend over a contiguous cache, so before a sequence runs its rows are gathered from its blocks into a
scratch cache (a lane of its own over the same weights and graphs, so the model's sessions keep theirs), and
the rows the step writes are stored back into its blocks after. When the same sequence runs again next, its
rows are still in the scratch cache and nothing is gathered. Each sequence thus computes exactly the numbers it
computes alone (`Session`), which is what the engine's tests hold the batch to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fuselane.engine.lane import DeviceMemory, Work
from fuselane.graph.ir import Role
from fuselane.lanes.cpu.lane import CpuLane


class CpuPaged:
    """Steps of many sequences on the cpu lane, over a pool of `blocks` blocks of `block_size` rows."""

    name = "cpu"

    def __init__(self, lane: CpuLane, blocks: int, block_size: int, *, overlap: bool = False) -> None:
        self.lane, self.block_size = lane.sibling(), block_size
        self.overlap = False  # a step runs on the host: there is nothing to overlap it with
        caches = {n: t.shape for n, t in self.lane.graph(1).tensors.items() if t.role is Role.CACHE}
        # per cache tensor: the scratch the graphs read (ctx rows) and the pool (rows of every block); np.zeros
        # maps pages lazily, so a pool larger than what the sequences reach costs address space, not memory
        self.scratch = {n: self.lane.cache(n, shape) for n, shape in caches.items()}
        self.pool = {n: np.zeros((blocks * block_size, shape[-1]), self.lane.dtype) for n, shape in caches.items()}
        self.resident: tuple[int, int] | None = None  # (sequence, rows) the scratch holds

    @staticmethod
    def block_bytes(lane: CpuLane, block_size: int) -> int:
        cfg = lane.cfg
        return cfg.n_layers * cfg.cache_values * np.dtype(lane.dtype).itemsize * block_size

    @staticmethod
    def device_memory(lane: CpuLane) -> DeviceMemory | None:
        return None  # host memory: the pool is sized in blocks

    def step(self, works: Sequence[Work]) -> list[int | None]:
        return [self._run(w) for w in works]

    def warm(self, max_seqs: int, chunk: int) -> int:
        """Nothing to make ready: the cpu lane builds a step's graph in microseconds and compiles nothing."""
        return 0

    def device_bytes(self) -> int:
        return 0

    def forget(self, seq: int) -> None:
        if self.resident is not None and self.resident[0] == seq:
            self.resident = None

    def _run(self, w: Work) -> int | None:
        if self.resident != (w.seq, w.pos):
            rows = w.table.rows(0, w.pos, self.block_size)
            for name, scratch in self.scratch.items():
                scratch[: w.pos] = self.pool[name][rows]
        end = w.pos + len(w.ids)
        logits = self.lane.forward(np.asarray(w.ids), w.pos)
        rows = w.table.rows(w.pos, end, self.block_size)
        for name, scratch in self.scratch.items():
            self.pool[name][rows] = scratch[w.pos : end]
        self.resident = (w.seq, end)
        return w.sampler(logits[-1]) if w.sampler is not None else None

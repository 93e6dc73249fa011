"""The cuda lane's paged form: a step's decode rows as one batch on the GPU, its prefill chunks one at a time.

The pool lives on the device: per cache tensor of the plan (a layer's keys, its values) one tensor of
`(blocks + 1) * block_size` rows in the `cache` knob's precision (the last block is the spare the padding rows
of a bucket write into). Block tables are written with each step as int32 device values.

Decode rows run together (`fuselane.lanes.cuda.run.paged`): the lane's plan compiled for a batch of B rows,
B the step's rows rounded up to a power of two (the buckets 1, 2, 4, 8, ... up to `--max-seqs`), each bucket's
step captured as one CUDA graph after its first runs (eager where the lane runs without graphs). Each row
takes the greedy pick of the graph or, when its sequence samples, a draw of the device sampler under its own
settings and seed, drawn inside the graph too.

Overlapped (`overlap`, on unless the model has a recurrent state; `fuselane.engine.engine`), a step of decode
rows is `launch`ed with its picks copied to pinned host memory behind an event (`BatchStep.ship`), and the step
after it is `launch_next`ed before the host reads them: the same bucket, its inputs advanced in place on the
device from the running step's (`triton/advance.py`: each row's pick as its id, one row on), the tables copied
up from pinned memory without waiting where one took a block; `collect` waits for the oldest step's event only.
A sequence the tokens end keeps its row in the step launched ahead, whose token is dropped; the draws of a
sampling row there advance only that sequence's generator, which is forgotten with it (a sequence that goes on
has no row dropped: the engine plans ahead only where every row's sequence goes on decoding), so no generator
of a sequence that goes on is moved.

Prefill chunks run through the lane's own single-sequence path (its prefill GEMMs and attention, over a
contiguous cache of `ctx` rows), each padded to a power of two of rows so ragged prompts share a few captured
steps (`_chunk_rows`): the sequence's rows are gathered from its blocks into that scratch cache
first (unless it holds them already, from this sequence's last chunk), and the rows the chunk writes are
scattered back into its blocks after. The scratch is a second lane over the same weights on the device, so
the model's own sessions keep their caches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fuselane.engine.lane import DeviceMemory, Work
from fuselane.errors import FuselaneError
from fuselane.graph.ir import Role
from fuselane.lanes.cuda.run.mismatch import PlanMismatch
from fuselane.runtime.session import DEFAULT_CHUNK

if TYPE_CHECKING:  # the lane imports its kernels' modules: only where the cuda lane runs
    from fuselane.lanes.cuda.run.lane import CudaLane
    from fuselane.lanes.cuda.run.paged import Flight


# The largest batch size made ready before serving (`CudaPaged.warm`), as vLLM captures its graphs up to a
# bound: past it a bucket is built when first met. A bucket holds its rows' logits and, once it samples, their
# sort (12 bytes a vocabulary entry a row: 0.47 GB at 256 rows of a 152k vocabulary), so warming every bucket
# of a large --max-seqs would hold memory for batches the pool may never run.
WARM_ROWS_MOST = 256


def _bucket(rows: int) -> int:
    """The batch size a step of `rows` decode rows runs at: the next power of two."""
    return 1 << (rows - 1).bit_length()


def _warm_chunk(lane: CudaLane) -> None:
    """One prefill chunk of the sessions' rows through a sibling of `lane` that reads the weights as the paged
    form does (`batch_prefill`), as vLLM profiles a run before sizing its cache: the f16 copies a chunk's
    products make on their first run (where the batch form takes them), its buffers (left in torch's cache
    for the paged form's own chunks) and its kernels' compiles happen now, so the free memory the pool is sized
    from is what serving leaves, and the first request does not wait for the compiles."""
    rows = min(DEFAULT_CHUNK, lane.ctx - 1)
    if rows > 1:
        lane.sibling(lane.batch_prefill).forward(np.zeros(rows, dtype=np.int32), 0)


def _chunk_rows(rows: int, pos: int, ctx: int, recurrent: bool) -> int:
    """The rows a prefill chunk of `rows` at `pos` runs at: the next power of two, so the chunks of a server's
    ragged prompts share a few steps (each size met is a plan bound, warmed and captured, and holds its buffers
    while the engine lives), unless the padding would pass the context, or the model's recurrent state would
    sum the padding rows; a single row stays one (the decode step)."""
    padded = _bucket(rows)
    return rows if rows == 1 or recurrent or pos + padded > ctx else padded


def _warm_buckets(max_seqs: int, blocks: int) -> list[int]:
    """The batch sizes made ready before serving: every bucket up to that of as many sequences as can run at once
    (at most `max_seqs`, each holding one of the pool's `blocks` at least), at most WARM_ROWS_MOST."""
    most = min(max_seqs, blocks, WARM_ROWS_MOST)
    return [1 << i for i in range(_bucket(most).bit_length())]


def _chunk_sizes(most: int, ctx: int) -> list[int]:
    """The rows a prefill chunk of at most `most` rows can run at from position 0 (`_chunk_rows`): the powers of
    two up to `most`'s bucket that fit the context of `ctx` rows (one row is the single lane's decode step)."""
    return [rows for i in range(_bucket(max(1, most)).bit_length()) if (rows := 1 << i) <= ctx]


class CudaPaged:
    """Steps of many sequences on the cuda lane over a pool of `blocks` blocks of `block_size` rows."""

    name = "cuda"

    def __init__(self, lane: CudaLane, blocks: int, block_size: int, *, overlap: bool = True) -> None:
        from fuselane.lanes.cuda.run.paged import Draws

        torch = lane.torch
        self.lane, self.torch, self.block_size, self.spare = lane, torch, block_size, blocks
        self.width = -(-lane.ctx // block_size)  # a table's blocks: as many as one context needs
        self.single = lane.sibling(lane.batch_prefill)  # the prompts' chunks read the weights as the steps do
        caches = {n: t.shape for n, t in self.single.plan(1).graph.tensors.items() if t.role is Role.CACHE}
        rows = (blocks + 1) * block_size
        self.pools = {
            n: torch.zeros((rows, s[-1]), dtype=lane.cache_dtype, device=lane.device) for n, s in caches.items()
        }
        self.single.make_caches(caches)  # one buffer, as a single lane's caches are
        self.scratch = {n: self.single.cache(n, s) for n, s in caches.items()}
        self.steps: dict[int, Any] = {}
        # a row of draws a sequence that has drawn, until it ends: a running one holds a block, and a preempted
        # one waits at the queue's head, so no new sequence joins before it does: at most `blocks` at once
        self.draws = Draws(lane, blocks + 1)
        self.resident: tuple[int, int] | None = None  # (sequence, rows) the scratch cache holds
        # a discarded step would have advanced a recurrent state: such a model's steps run one after another
        self.overlap = overlap and not lane.recurrent
        # launched steps whose tokens are not read yet: each with its rows and whether it draws
        self._flights: deque[tuple[Flight, int, bool]] = deque()
        self._lens: list[int] = []  # the blocks of each row's table, as the last step launched holds them
        self._batch(1)  # a model whose batch form the lane cannot run is refused here, not at the first step

    @staticmethod
    def block_bytes(lane: CudaLane, block_size: int) -> int:
        itemsize = lane.torch.empty((), dtype=lane.cache_dtype).element_size()
        return 2 * lane.cfg.n_layers * lane.cfg.kv_width * itemsize * block_size  # keys and values

    @staticmethod
    def device_memory(lane: CudaLane) -> DeviceMemory | None:
        if lane.device.type != "cuda":  # interpreted: the pool is host memory, sized in blocks
            return None
        _warm_chunk(lane)
        free, total = lane.torch.cuda.mem_get_info(lane.device)
        return DeviceMemory(total=total, used=total - free)

    def step(self, works: Sequence[Work]) -> list[int | None]:
        rows = [w for w in works if w.samples and len(w.ids) == 1]
        tokens: dict[int, int | None] = dict(zip((id(w) for w in rows), self._decode(rows), strict=True))
        for w in works:
            if id(w) not in tokens:
                tokens[id(w)] = self._chunk(w)
        return [tokens[id(w)] for w in works]

    def warm(self, max_seqs: int, chunk: int) -> int:
        """Build, compile and capture every decode bucket up to `max_seqs`' (greedy and sampling; no more sequences
        than the pool has blocks, and at most WARM_ROWS_MOST rows) and every padded prefill chunk up to `chunk`
        rows, as vLLM captures its batch sizes at start-up: each new size is a plan bound, its kernels compiled
        at its rows and its graph captured, seconds on a fresh host, which a request would otherwise wait out.
        The buckets run padding rows only (the spare block), the chunks write only the scratch cache: no
        sequence's blocks are touched."""
        from fuselane.lanes.cuda.run.lane import WARMUP_RUNS
        from fuselane.lanes.cuda.run.paged import layout
        from fuselane.lanes.cuda.triton.advance import advance

        runs = WARMUP_RUNS + 1 if self.lane.use_graphs else 1  # the eager runs, then the capture
        buckets = _warm_buckets(max_seqs, self.spare)
        for rows in buckets:
            step = self._batch(rows)
            step.write(layout(rows, self.width, [], [], [], [], self.spare, self.block_size))
            for sampling in (False, True):
                for _ in range(runs):
                    step.launch(sampling)
            if self.overlap:  # the advance's compile for this bucket (it moves only the spare block's rows)
                advance(step.inputs, step.picked, rows, rows, self.width, self.block_size)
        chunks = [] if self.lane.recurrent else _chunk_sizes(min(chunk, self.lane.ctx - 1), self.lane.ctx)
        # the largest first: its activations take the lane's arena, which every smaller chunk then fits
        # (`CudaLane.activation_arena`), where from the smallest up each size took a fresh arena twice the last
        for rows in sorted(chunks, reverse=True):
            for _ in range(runs):
                self.single.forward(np.zeros(rows, dtype=np.int32), 0)
        self.resident = None  # the scratch holds the warm-up's rows now
        return len(buckets) + len(chunks)

    def device_bytes(self) -> int:
        lane = self.single
        return int(lane.torch.cuda.memory_allocated(lane.device)) if lane.device.type == "cuda" else 0

    def forget(self, seq: int) -> None:
        self.draws.forget(seq)
        if self.resident is not None and self.resident[0] == seq:
            self.resident = None

    # ---- decode rows: one batch ----------------------------------------------------------------------------

    def _batch(self, rows: int):
        from fuselane.lanes.cuda.run.paged import BatchStep

        if rows not in self.steps:
            try:
                self.steps[rows] = BatchStep(self.lane, rows, self.pools, self.block_size, self.width, self.draws)
            except (PlanMismatch, NotImplementedError, ValueError) as e:
                raise FuselaneError(f"the cuda lane cannot run this model's batch form: {e}") from None
        return self.steps[rows]

    def _decode(self, works: Sequence[Work]) -> list[int]:
        from fuselane.lanes.cuda.run.paged import picks

        if not works:
            return []
        step, _ = self._write_and_launch(works)
        return picks(step, len(works))

    def _write_and_launch(self, works: Sequence[Work]) -> tuple[Any, bool]:
        """The decode rows' step: its inputs written from the host, launched; the step, and whether it draws."""
        from fuselane.lanes.cuda.run.paged import NO_SLOT, layout

        step = self._batch(_bucket(len(works)))
        bs = self.block_size
        positions = [w.pos for w in works]
        slots = [w.table.blocks[p // bs] * bs + p % bs for w, p in zip(works, positions, strict=True)]
        tables = [w.table.blocks for w in works]
        ids = [w.ids[0] for w in works]
        step.write(layout(step.rows, self.width, ids, positions, slots, tables, self.spare, bs))
        draws = [NO_SLOT if w.sampler.params.greedy else self.draws.slot(w.seq, w.sampler.params) for w in works]
        sampling = any(d != NO_SLOT for d in draws)
        if sampling:
            step.write_slots(draws)
        step.launch(sampling)
        return step, sampling

    # ---- the overlapped decode: a step launched before the tokens of the one before are read -----------------

    def launch(self, works: Sequence[Work]) -> None:
        """Launch a step of decode rows only (one token each, every one sampling), its inputs written from the
        host, without reading its tokens (`collect` reads them). Only when no step is in flight."""
        if self._flights:
            raise RuntimeError("a decode step is launched from the host only when none is in flight")
        step, sampling = self._write_and_launch(works)
        self._lens = [len(w.table.blocks) for w in works]
        self._flights.append((step.ship(), len(works), sampling))

    def launch_next(self, works: Sequence[Work]) -> None:
        """Launch the step after the last one launched, before that one's tokens are read: the same sequences in
        the same rows (`works`: each one row on, its table holding that row), the ids being the last step's
        picks. Its inputs are advanced on the device (`triton/advance.py`); the tables that took a block since
        are written from pinned memory without waiting."""
        from fuselane.lanes.cuda.triton.advance import advance

        last, n, sampling = self._flights[-1]
        if len(works) != n:
            raise RuntimeError(f"a step launched ahead holds the {n} rows of the one before, not {len(works)}")
        step = last.step
        lens = [len(w.table.blocks) for w in works]
        if lens != self._lens:  # tables only grow while the rows stay: a length is all that can change
            step.write_tables([w.table.blocks for w in works], self.spare)
            self._lens = lens
        advance(step.inputs, step.picked, n, step.rows, self.width, self.block_size)
        step.launch(sampling)
        self._flights.append((step.ship(), n, sampling))

    def collect(self) -> list[int]:
        """The tokens of the oldest step launched and not read yet: waits for that step alone."""
        flight, n, _ = self._flights.popleft()
        return flight.tokens(n)

    def discard(self) -> None:
        """Forget the steps in flight (a failed step's successor, a shutdown): their tokens are never read."""
        self._flights.clear()

    # ---- prefill chunks: the single-sequence path over a gathered cache ---------------------------------

    def _chunk(self, w: Work) -> int | None:
        torch, bs = self.torch, self.block_size
        if self.resident != (w.seq, w.pos):
            held = torch.from_numpy(w.table.rows(0, w.pos, bs)).to(self.lane.device)
            for name, scratch in self.scratch.items():
                torch.index_select(self.pools[name], 0, held, out=scratch[: w.pos])
        end = w.pos + len(w.ids)
        logits = self._forward_padded(w)
        fresh = torch.from_numpy(w.table.rows(w.pos, end, bs)).to(self.lane.device)
        for name, scratch in self.scratch.items():
            self.pools[name].index_copy_(0, fresh, scratch[w.pos : end])
        self.resident = (w.seq, end)
        return w.sampler(logits[-1]) if w.sampler is not None else None

    def _forward_padded(self, w: Work) -> np.ndarray:
        """The chunk run at its bucket's rows (`_chunk_rows`): token 0 fills the rows past its own, whose keys
        and values land in the scratch cache past the chunk's end (never copied back, and overwritten by the
        sequence's next chunk before anything reads them). A chunk that samples runs at its own rows: the
        logits it needs are its last row's."""
        n = len(w.ids)
        rows = n if w.sampler is not None else _chunk_rows(n, w.pos, self.lane.ctx, self.lane.recurrent)
        ids = np.zeros(rows, dtype=np.int32)
        ids[:n] = w.ids
        return self.single.forward(ids, w.pos)

"""The cuda lane's batch form over a paged KV pool: one decode step for `rows` sequences, each at its own
position over its own blocks, as one launch sequence (captured as one CUDA graph per batch size).

The plan is the lane's own, compiled for `Form.BATCH` under the `batch` knob (`CudaShim`: up to the GEMV's rows
a batch's products are GEMVs over its rows, in parts where one activation feeds several; under int8
activations they read each row's int8 form, as the single-sequence step reads its one row's, in the int8
GEMV's formats: past one row the int8 GEMV over the rows, `triton/gemv/q8_rows.py`; past the GEMV's rows they
multiply as a chunk's do, on the f16 tensor cores, reading each matrix once for every row: under
`prefill=auto` its f16 copies where they fit, else each decoded into the lane's scratch, `CudaLane.batch_prefill`) with
`rope_epilogue=off` past one row, so every rotation is a launch of its own that turns each row at its own
position. A batch of one row runs the single step's launches: the one-row GEMV's epilogues (the rotations in
the QKV product's, at the row's own position; the add and norm in the output projection's last program). The
plan's cache writes land in staging rows (one row a sequence); each layer's attention stores them into the rows'
blocks and attends over each row's blocks (`launch.PagedRows`, `triton/attention/paged.py`).

Inputs are one int32 device tensor written from the host before a step: the rows' token ids, positions,
pool slots (where the new key and value go), lengths and block tables (padded to the widest a context needs).
Rows past the batch's sequences (a bucket is a power of two) feed token 0 at position 0, write their key and
value into a spare block past the pool's and attend over it alone: their results are never read.

The step ends with an arg-max a row (the greedy pick, `triton/sample.py`), part of the captured graph. Where a
row samples, the step ends with the batch's draws too (`sample.sample_rows`: one sort of every row and one
launch that draws each sampling row under its own sequence's settings and Philox generator, which live on the
device in `Draws`' tables, a row a sequence, found through the step's slot column), also inside the graph: a
bucket keeps two graphs, one that samples and one that only picks greedily, so greedy steps sort nothing.

For the overlapped decode (`engine/cuda.py`) a step's picks also go to pinned host memory behind an event
(`ship`, `Flight`), and the next step's tables come from pinned memory without a wait (`write_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.fuse.optimizer import Plan, optimize
from fuselane.fuse.views import leaves
from fuselane.graph.ir import Form, QuantizedActs, Role
from fuselane.graph.ops import Attention
from fuselane.lanes.cuda.plan.kernels import BATCH_COLUMNS, BATCH_ID, BATCH_LENGTH, BATCH_POSITION, BATCH_SLOT
from fuselane.lanes.cuda.plan.knobs import PrefillWeights, RopeEpilogue
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.lanes.cuda.run.buffers import pooled_buffers
from fuselane.lanes.cuda.run.lane import WARMUP_RUNS, CudaLane, decodes_in_kernel, int8_form
from fuselane.models import recognizer
from fuselane.models.qwen import IDS, LOGITS, POS
from fuselane.runtime.sampling import SamplingParams, nan_logits

# The columns of the step's inputs, one int32 row each (then the tables, `width` columns a row): kernels.py's.
ID, POSITION, SLOT, LENGTH = BATCH_ID, BATCH_POSITION, BATCH_SLOT, BATCH_LENGTH
COLUMNS = BATCH_COLUMNS
NO_SLOT = -1  # a row that draws nothing: greedy, or padding


def cache_read_in_place(plan: Plan) -> str | None:
    """Why the paged form cannot run `plan`, where an op other than an attention reads a cache: a sequence's rows
    sit in blocks of a pool that only the paged attention walks (a latent cache's values are read as a slice)."""
    caches = {name for name, t in plan.graph.tensors.items() if t.role is Role.CACHE}
    for op in plan.ops:
        for leaf in leaves(op):
            read = sorted(set(leaf.ins) & caches)
            if read and not isinstance(leaf.sym, Attention):
                return f"{leaf.out} reads the cache {read[0]} in place; a batch's caches are blocks attention reads"
    return None


class BatchStep:
    """The plan for `rows` sequences bound to the pool's tensors (`pools`: by cache name, `block_size` rows a
    block, tables `width` blocks wide), with its inputs, its staging rows and its picks."""

    def __init__(
        self, lane: CudaLane, rows: int, pools: dict[str, Any], block_size: int, width: int, draws: Draws
    ) -> None:
        from fuselane.lanes.cuda.run.launch import Bound, PagedRows, bind
        from fuselane.lanes.cuda.triton import sample

        torch, device = lane.torch, lane.device
        self.lane, self.torch, self.sample, self.rows, self.width = lane, torch, sample, rows, width
        # a batch of one keeps the lane's rotations in the QKV product's epilogue, as the single step does
        turns = lane.shim.knobs.rope_epilogue if rows == 1 else RopeEpilogue.OFF
        knobs = replace(lane.shim.knobs, batch=True, rope_epilogue=turns, prefill_weights=lane.batch_prefill)
        held = [h for h in lane.held if h != "rows_a_warp"]
        raw = recognizer(lane.cfg).recognize(lane.cfg, lane.tensors, Form.BATCH, rows=rows, ctx=lane.ctx)
        self.plan = optimize(raw, CudaShim(knobs, held=lane.held), held=held)
        g = self.plan.graph
        why = cache_read_in_place(self.plan)
        if why is not None:
            raise NotImplementedError(why)

        def f32(shape: tuple[int, ...]) -> Any:
            return torch.zeros(shape, dtype=torch.float32, device=device)

        bufs, q8 = pooled_buffers(self.plan, f32, lambda shape: int8_form(shape, device))
        for name, t in g.tensors.items():
            if t.role is Role.CACHE:  # the step's staging rows: the attention stores them into the blocks
                bufs[name] = torch.zeros((rows, t.shape[-1]), dtype=lane.cache_dtype, device=device)
            elif t.role is Role.OUTPUT:
                bufs[name] = f32(t.shape)
                if isinstance(t.storage, QuantizedActs):
                    q8[name] = int8_form(t.shape, device)
        self.inputs = torch.zeros(rows * (COLUMNS + width), dtype=torch.int32, device=device)
        columns = self.inputs[: rows * COLUMNS].view(COLUMNS, rows)
        bufs[IDS] = columns[ID]
        bufs[POS] = torch.zeros(1, dtype=torch.int32, device=device)  # staging rows start at row 0
        tables = self.inputs[rows * COLUMNS :].view(rows, width)
        paged = PagedRows(columns[POSITION], columns[SLOT], tables, columns[LENGTH], pools, block_size)
        self.bufs = bufs
        bound = Bound(
            g, bufs, lane.raw, lane.vec, lane.dense,
            in_place=decodes_in_kernel(knobs), q8=q8, paged=paged, sms=lane.shim.knobs.chip.sms,
            f16_scratch=lane.f16_scratch() if lane.batch_prefill is PrefillWeights.F16_SCRATCH else None,
        )  # fmt: skip
        self.launch_list = [launch for op in self.plan.ops for launch in bind(op, bound)]
        self.logits = bufs[LOGITS].view(rows, -1)
        self.picked = torch.zeros((rows, sample.PICKED_VALUES), dtype=sample.PICKED_DTYPE, device=device)
        vocab = self.logits.shape[1]
        scratch = torch.zeros((rows, sample.argmax_scratch_size(vocab)), dtype=torch.float32, device=device)
        self.greedy = [lambda: sample.argmax_rows(self.logits, self.picked, scratch)]  # every row's, one launch
        self.draws = draws
        self.slots = torch.full((rows,), NO_SLOT, dtype=torch.int32, device=device)  # each row's sequence's draws
        self.sorted: tuple[Any, Any] | None = None  # the rows sorted for their draws: made by the first that samples
        self.graphs: dict[bool, Any] = {}  # sampling or not -> its captured graph
        self.runs = {False: 0, True: 0}
        # the overlapped decode's host side (`ship`, `write_tables`): two of each, as at most two steps are in
        # flight, the one whose picks the host waits for and the one launched after it
        pinned = device.type == "cuda"
        self.host_picks = [torch.zeros(self.picked.shape, dtype=self.picked.dtype, pin_memory=pinned) for _ in "ab"]
        self.host_tables = [torch.zeros(rows * width, dtype=torch.int32, pin_memory=pinned) for _ in "ab"]
        self.turn = 0

    def write(self, values: np.ndarray) -> None:
        """The step's inputs from the host: `COLUMNS` rows of `rows` values, then the tables (`layout`)."""
        self.inputs.copy_(self.torch.from_numpy(values), non_blocking=False)

    def write_tables(self, tables: list[list[int]], spare: int) -> None:
        """The rows' block tables (padded with the `spare` block, as `layout` pads them) from pinned host memory,
        without waiting: the overlapped decode writes them while the step before still runs. The staging is
        one of two, taken in turn with the picks' (`ship`): the one written two steps ago, whose copy the
        host has seen done (it waited for that step's picks, which the GPU copied after it)."""
        grid = self.host_tables[self.turn % 2].numpy().reshape(self.rows, self.width)
        grid[:, :] = spare
        for i, table in enumerate(tables):
            grid[i, : len(table)] = table
        self.inputs[self.rows * COLUMNS :].copy_(self.host_tables[self.turn % 2], non_blocking=True)

    def ship(self) -> Flight:
        """After a launch: its picks copied to pinned host memory without waiting, and an event after the copy,
        so the host can wait for this step alone (`Flight.tokens`) while the GPU runs the next."""
        host = self.host_picks[self.turn % 2]
        self.turn += 1
        host.copy_(self.picked, non_blocking=True)
        event = None
        if self.picked.device.type == "cuda":
            event = self.torch.cuda.Event()
            event.record()
        return Flight(self, host, event)

    def write_slots(self, slots: list[int]) -> None:
        """Each row's slot in the draws' tables (`NO_SLOT` for a greedy row), padding rows none."""
        values = np.full(self.rows, NO_SLOT, dtype=np.int32)
        values[: len(slots)] = slots
        self.slots.copy_(self.torch.from_numpy(values), non_blocking=False)

    def launch(self, sampling: bool = False) -> None:
        """Run the step and the greedy picks on the inputs written, then, `sampling`, the draws of the rows with
        a slot (`write_slots`): eagerly for the first runs of each (Triton compiles each kernel on its first
        launch), then as the graph captured once for each and replayed."""
        graph = self.graphs.get(sampling)
        if graph is None and self.lane.use_graphs and self.runs[sampling] >= WARMUP_RUNS:
            graph = self.graphs[sampling] = self._capture(sampling)
        if graph is not None:
            graph.replay()
            return
        self._eager(sampling)
        self.runs[sampling] += 1

    def _eager(self, sampling: bool) -> None:
        tail = [self._draw] if sampling else []
        with self.lane.launching():
            for launch in (*self.launch_list, *self.greedy, *tail):
                launch()

    def _draw(self) -> None:
        if self.sorted is None:  # made by an eager run, before any capture
            torch, shape, device = self.torch, self.logits.shape, self.logits.device
            self.sorted = tuple(torch.empty(shape, dtype=t, device=device) for t in (torch.float32, torch.int64))
        vals, idx = self.sorted
        d = self.draws
        self.sample.sample_rows(self.logits, vals, idx, self.slots, d.params, d.rng, self.picked)

    def _capture(self, sampling: bool) -> Any:
        torch = self.torch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # a run on the capture stream first, as torch advises (an eager run is on the lane's stream, which the
        # graph is captured on; nothing it advances is kept)
        self._eager(False)
        with torch.cuda.graph(graph, stream=self.lane.capture_stream()):
            self._eager(sampling)
        return graph


def layout(rows: int, width: int, ids, positions, slots, tables, spare: int, block_size: int) -> np.ndarray:
    """A step's inputs for `len(ids)` sequences in a bucket of `rows`: each column padded with the spare
    block's row (token 0 at position 0, its key and value into the spare block, attending over it alone)."""
    n = len(ids)
    values = np.zeros(rows * (COLUMNS + width), dtype=np.int32)
    columns = values[: rows * COLUMNS].reshape(COLUMNS, rows)
    columns[ID, :n], columns[POSITION, :n], columns[SLOT, :n] = ids, positions, slots
    columns[LENGTH, :n] = np.asarray(positions) + 1
    columns[SLOT, n:], columns[LENGTH, n:] = spare * block_size, 1
    grid = values[rows * COLUMNS :].reshape(rows, width)
    grid[:, :] = spare
    for i, table in enumerate(tables):
        grid[i, : len(table)] = table
    return values


class Draws:
    """The device sampler's state of each sampling sequence: its settings (temperature, top-p, candidates) and
    its Philox seed and counter, a row of two device tables each, the tables' row a sequence's slot. A step's
    draws read and advance them in place (`sample.sample_rows`), so a captured step draws with no copy."""

    def __init__(self, lane: CudaLane, slots: int) -> None:
        from fuselane.lanes.cuda.triton import sample

        torch, device = lane.torch, lane.device
        self.sample, self.torch, self.vocab = sample, torch, lane.cfg.vocab
        self.params = torch.ones((slots, sample.ROW_PARAMS), dtype=torch.float32, device=device)
        self.rng = torch.zeros((slots, sample.RNG_VALUES), dtype=torch.int64, device=device)
        self.free = list(range(slots - 1, -1, -1))
        self.held: dict[int, int] = {}

    def forget(self, seq: int) -> None:
        slot = self.held.pop(seq, None)
        if slot is not None:
            self.free.append(slot)

    def slot(self, seq: int, p: SamplingParams) -> int:
        """The sequence's row of the tables, armed on its first draw as `DeviceSampler.arm` arms a loop."""
        if seq not in self.held:
            if not self.free:  # the engine keeps at most a sequence a block alive that has drawn (engine/cuda.py)
                raise FuselaneError("the cuda lane's draws hold no free row for another sampling sequence")
            s, torch = self.sample, self.torch
            slot = self.held[seq] = self.free.pop()
            params = [0.0] * s.ROW_PARAMS
            params[s.TEMPERATURE], params[s.TOP_P] = p.temperature, p.top_p
            params[s.CANDIDATES] = p.top_k if 0 < p.top_k < self.vocab else self.vocab
            seed = np.random.SeedSequence(p.seed).generate_state(1, np.uint64).view(np.int64)[0]
            rng = [0] * s.RNG_VALUES
            rng[s.SEED] = int(seed)
            self.params[slot] = torch.tensor(params, dtype=torch.float32)
            self.rng[slot] = torch.tensor(rng, dtype=torch.int64)
        return self.held[seq]


def picks(step: BatchStep, n: int) -> list[int]:
    """The first `n` rows' tokens, read from the device; NaN logits in any of them is the lane's error."""
    return _tokens(step.sample, step.picked[:n].cpu().numpy())


def _tokens(sample: Any, values: np.ndarray) -> list[int]:
    if values[:, sample.NAN_FLAG].any():
        raise FuselaneError(nan_logits("cuda"))
    return [int(t) for t in values[:, sample.TOKEN]]


@dataclass(frozen=True, slots=True)
class Flight:
    """A launched step whose picks are on their way to the host (`BatchStep.ship`)."""

    step: BatchStep
    host: Any  # the pinned copy of its picks
    event: Any  # recorded after the copy; None on the host (the copy has happened)

    def tokens(self, n: int) -> list[int]:
        """The first `n` rows' tokens: waits for this step's copy only, not for any step launched after it."""
        if self.event is not None:
            self.event.synchronize()
        return _tokens(self.step.sample, self.host[:n].numpy())

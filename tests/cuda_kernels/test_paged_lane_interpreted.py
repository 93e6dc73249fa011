"""The cuda lane's paged form (a step's decode rows as one batch over the device pool, prefill chunks through the
single-sequence path) under Triton's interpreter, against the cpu lane alone in f64: batch equals single.

Interpreted kernels are slow, so this runs few tokens of a tiny model: three sequences of different lengths,
two at a time, so one joins when another leaves, decode buckets of 2 and 1, a prompt prefilled in two chunks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.engine.batch import engine_for  # noqa: E402
from fuselane.engine.sequence import Event, Request  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.graph.ir import Role  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY  # noqa: E402

CTX = 32
PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40]]
MAX_TOKENS = [3, 2, 2]


class Recorder:
    """The paged lane with the decode rows of each step written down."""

    def __init__(self, lane) -> None:
        self.lane, self.name, self.rows = lane, lane.name, []

    def step(self, works):
        self.rows.append(sum(w.samples for w in works))
        return self.lane.step(works)

    def forget(self, seq):
        self.lane.forget(seq)

    def device_bytes(self):
        return self.lane.device_bytes()

    def warm(self, max_seqs, chunk):
        return self.lane.warm(max_seqs, chunk)


def test_paged_cuda_lane_equals_cpu_alone(tmp_path):
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "f16", seed=5)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    engine = engine_for(gpu, blocks=6, max_seqs=2, max_queue=3, block_size=4, chunk=6)
    # every batch size (1, 2) and chunk size (1, 2, 4, 8) made ready before the first request
    assert engine.warm() == 2 + 4
    warmed = (sorted(engine.lane.steps), sorted(engine.lane.single._steps))
    # the largest chunk warmed first: every chunk's activations lie in the one arena it took
    single = engine.lane.single
    arenas = {
        buf.untyped_storage().data_ptr()
        for step in single._steps.values()
        for name, buf in step.bufs.items()
        if name in step.plan.graph.tensors and step.plan.graph.tensors[name].role is Role.ACTIVATION
    }
    assert arenas == {single._arena.untyped_storage().data_ptr()}
    engine.lane = recorder = Recorder(engine.lane)
    events: dict[int, list[Event]] = {}
    ids = [
        engine.submit(Request(tuple(p), n, GREEDY), lambda e: events.setdefault(e.seq, []).append(e))
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    engine.run_until_idle()
    for seq, prompt, n in zip(ids, PROMPTS, MAX_TOKENS, strict=True):
        got = [t for e in events[seq] for t in e.tokens]
        assert not any(e.error for e in events[seq])
        assert got == list(ref.generate_ids(ref.session(), prompt, max_tokens=n, sampling=GREEDY))
    assert {1, 2} <= set(recorder.rows)  # batches of two rows and of one
    assert engine.pool.used == 0 and sorted(engine.lane.lane.steps) == [1, 2]
    # the prompts' chunks (3, 3, 6 and 1 rows: a prompt's last token is a decode row) ran padded to powers of two,
    # at sizes the warm-up had made ready: serving built no step of its own
    assert sorted(engine.lane.lane.single._steps) == [(1, False), (2, False), (4, False), (8, False)]
    assert (sorted(engine.lane.lane.steps), sorted(engine.lane.lane.single._steps)) == warmed


def test_a_chunk_pads_to_a_power_of_two_unless_the_context_or_a_recurrent_state_forbids():
    from fuselane.engine.cuda import _chunk_rows

    assert [_chunk_rows(n, 0, 64, False) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert _chunk_rows(5, 58, 64, False) == 5  # 8 rows from 58 would pass the context of 64
    assert _chunk_rows(5, 56, 64, False) == 8
    assert _chunk_rows(5, 0, 64, True) == 5  # a recurrent state would sum the padding


def test_a_steps_inputs_pad_the_bucket_with_the_spare_block():
    """Two sequences in a bucket of four: their ids, positions, slots, lengths and tables, then two padding rows
    of token 0 at position 0 writing into and reading only the spare block (7, after the pool's 7)."""
    from fuselane.engine.cuda import _bucket
    from fuselane.lanes.cuda.run.paged import COLUMNS, layout

    assert [_bucket(n) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    values = layout(4, 3, [11, 12], [5, 0], [2 * 4 + 1, 6 * 4], [[3, 2], [6]], spare=7, block_size=4)
    columns, tables = values[: 4 * COLUMNS].reshape(COLUMNS, 4), values[4 * COLUMNS :].reshape(4, 3)
    assert columns.tolist() == [[11, 12, 0, 0], [5, 0, 0, 0], [9, 24, 28, 28], [6, 1, 1, 1]]
    assert tables.tolist() == [[3, 2, 7], [6, 7, 7], [7, 7, 7], [7, 7, 7]]


def test_a_wide_bucket_multiplies_as_a_chunk_within_the_contract(tmp_path):
    """Nine decode rows (a bucket of 16, past the GEMV's 8 rows): the batch's products take the chunk's GEMMs
    (the f16 copies, reading each matrix once for every row), so its gated pair runs as its two products and its
    GLU, where a bucket of 8 keeps the one GEMV launch; each row's logits are within the lane's contract of the
    cpu lane's in f64 for that sequence alone, and its greedy pick is the arg-max of its row."""
    from fuselane.engine.blocks import BlockPool, BlockTable
    from fuselane.engine.cuda import CudaPaged
    from fuselane.engine.lane import Work
    from fuselane.fuse.views import class_of
    from fuselane.graph.classes import ClassId as C
    from fuselane.runtime.sampling import Sampler

    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "f16", seed=5)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    prompts = [[5 + i, 11 * i % 50 + 1][: 1 + i % 2] for i in range(9)]  # some at position 1 over a prefilled row
    paged, pool = CudaPaged(gpu.lane, 12, 4), BlockPool(12, 4)
    tables = [BlockTable() for _ in prompts]
    for seq, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        assert pool.grow(t, len(p))
        if len(p) > 1:
            paged.step([Work(seq, tuple(p[:-1]), 0, t, None)])
    works = [Work(s, (p[-1],), len(p) - 1, tables[s], Sampler(GREEDY)) for s, p in enumerate(prompts)]
    tokens = paged.step(works)
    step = paged.steps[16]
    classes = [class_of(op) for op in step.plan.ops]
    assert C.GEMV_GATE_UP_GLU not in classes and classes.count(C.GLU_ACT_MUL) == gpu.cfg.n_layers
    logits = step.logits[: len(prompts)].float().cpu().numpy()
    for i, p in enumerate(prompts):
        want = ref.session().feed(p)
        err = float(np.max(np.abs(logits[i] - want)) / np.max(np.abs(want)))
        assert err <= tol, f"row {i}: {err:.2e} > {tol:.2e}"
        assert tokens[i] == int(np.argmax(logits[i]))


def test_the_chunk_sizes_warmed_are_those_a_prompt_can_take_within_the_context():
    from fuselane.engine.cuda import _chunk_sizes

    assert _chunk_sizes(256, 4096) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert _chunk_sizes(200, 4096) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # 200 rows run padded to 256
    assert _chunk_sizes(31, 31 + 1) == [1, 2, 4, 8, 16, 32]
    assert _chunk_sizes(99, 100) == [1, 2, 4, 8, 16, 32, 64]  # 128 rows would pass the context: never padded to it
    assert _chunk_sizes(1, 2) == [1]


def test_the_batch_sizes_warmed_are_those_the_pool_can_run_up_to_a_bound():
    from fuselane.engine.cuda import WARM_ROWS_MOST, _warm_buckets

    assert _warm_buckets(16, 4096) == [1, 2, 4, 8, 16]
    assert _warm_buckets(9, 4096) == [1, 2, 4, 8, 16]  # nine sequences run in a bucket of 16
    assert _warm_buckets(64, 5) == [1, 2, 4, 8]  # five blocks run five sequences at most
    assert _warm_buckets(65536, 1 << 20)[-1] == WARM_ROWS_MOST  # a huge --max-seqs warms no huge bucket


def test_a_batch_of_one_binds_the_single_steps_launches(tmp_path):
    """One sequence in a bucket of one: its plan takes the one-row GEMV's epilogues as the single step's does (the
    query's and key's rotation in the QKV product's epilogue, turning at the row's own position and landing the
    key in the step's staging row; the output projection's add and norm in its last program), so it binds the
    single step's launches, where a bucket of two turns and norms in launches of their own. (Its logits against
    the cpu lane's: tests/cuda/test_paged_cuda.py, compiled, where a bucket of one runs under int8 activations.)"""
    from fuselane.engine.cuda import CudaPaged
    from fuselane.graph.classes import ClassId as C

    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q4_k_m", seed=7)
    gpu = load(path, lane="cuda", ctx=CTX)
    paged = CudaPaged(gpu.lane, 4, 4)
    one, two = paged._batch(1), paged._batch(2)
    epilogues = {C.QKV_HEAD_EPILOGUE, C.GEMV_NORM_EPILOGUE}
    assert epilogues <= {c for op in one.plan.ops for c in _classes_in(op)}
    assert not epilogues & {c for op in two.plan.ops for c in _classes_in(op)}
    assert len(one.launch_list) == gpu.lane.step(1).launches < len(two.launch_list)


def _classes_in(op):
    """The classes of an op and of every part it fuses or merges."""
    from fuselane.fuse.views import class_of

    yield class_of(op)
    for part in getattr(op.sym, "parts", ()):
        yield from _classes_in(part)


def test_a_sequence_prefills_from_the_scratch_and_the_paged_form_as_its_steps_multiply(tmp_path):
    # `prefill=auto`: a session's chunks decode into the scratch; the batch form's steps (and so the paged
    # form's chunks, its warm-up's among them) take `batch_prefill` (the copies, as a GPU with room would),
    # on a sibling that shares the lane's copies
    from fuselane.lanes.cuda.plan.knobs import PrefillWeights

    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q4_k_m", seed=7)
    lane = load(path, lane="cuda", ctx=32).lane
    assert lane.shim.knobs.prefill_weights is PrefillWeights.F16_SCRATCH and lane.f16_scratch() is not None
    assert lane.batch_prefill is PrefillWeights.F16_COPY
    paged = lane.sibling(lane.batch_prefill)
    assert paged.shim.knobs.prefill_weights is PrefillWeights.F16_COPY and paged.f16_scratch() is None
    assert paged._dense is lane._dense
    paged.forward(np.zeros(12, dtype=np.int32), 0)  # past the GEMV's rows: the products make their copies
    assert lane._dense and lane.shim.knobs.prefill_weights is PrefillWeights.F16_SCRATCH

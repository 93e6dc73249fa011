"""The rows a cuda lane's session runs a prompt in under `prefill=f16-scratch` (`CudaLane.sized_workspace`): 512
where a 512-row chunk's workspace holds the share (`run/workspace`), 256 where only a 256-row one's does (a small
model in a low-bit mix), else 512 with the whole scratch; the knob `chunk_rows` sets them. Sized from the real
plans of a Qwen2.5-0.5B-shaped checkpoint, on the host (nothing runs)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the lane on host tensors
pytest.importorskip("triton")

from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.run import workspace  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

CTX = 641  # bench's context at -p 512 -n 128


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    files = {mix: write_synthetic(folder / f"{mix}.gguf", "qwen2.5-0.5b", mix, seed=4) for mix in ("q4_k_m", "q2_k")}
    files["mixture"] = write_synthetic(folder / "mixture.gguf", "tiny-qwen3moe", "q8_0", seed=4)
    return files


def _sized(path, *knobs):
    model = load(path, lane="cuda", ctx=CTX, knobs=list(knobs))
    return model, model.lane.sized_workspace()


def _within(ws) -> bool:
    """Recount the share from the workspace's own figures: the scratch and the largest product's operands beside
    the held bytes and cuBLAS's."""
    return ws.within and ws.held_bytes + ws.cublas_bytes + 2 * ws.scratch_values <= ws.share_bytes


def test_a_small_q4_k_m_holds_its_share_in_512_row_chunks(checkpoints):
    model, ws = _sized(checkpoints["q4_k_m"])
    assert ws.rows == kernels.SCRATCH_CHUNK_ROWS and _within(ws)
    assert model.session().chunk == ws.rows
    largest = 2 * 4864 * 896  # the gated pair
    assert 1 < -(-largest // ws.scratch_values) <= kernels.SCRATCH_MOST_SLABS


def test_a_small_q2_k_takes_256_row_chunks_where_512_cannot_hold_the_share(checkpoints):
    model, ws = _sized(checkpoints["q2_k"])
    assert ws.rows == workspace.chunk_rows(kernels.SCRATCH_CHUNK_ROWS)[1] and _within(ws)
    assert model.session().chunk == ws.rows
    # at 512 rows the arena alone leaves too little: the whole scratch, the share missed
    _, whole = _sized(checkpoints["q2_k"], "chunk_rows=512")
    assert whole.rows == 512 and not whole.within and whole.held_bytes > ws.held_bytes


def test_the_knob_sets_the_rows_and_the_session_takes_them(checkpoints):
    model, ws = _sized(checkpoints["q4_k_m"], "chunk_rows=128")
    assert ws.rows == 128 and model.session().chunk == 128
    # a context shorter than the chunk sizes at the context
    short = load(checkpoints["q4_k_m"], lane="cuda", ctx=100)
    assert short.lane.sized_workspace().rows == 100 and short.session().chunk == 100


@pytest.mark.parametrize("mix", ["q4_k_m", "q2_k", "mixture"])
def test_explain_says_what_the_lane_sizes(checkpoints, monkeypatch, mix):
    # `fuselane explain --form prefill` works the workspace out from the file's tensors, the lane from its upload
    # and its plans: the same figures at the default context
    from fuselane.explain import DEFAULT_CTX, prefill_workspace

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    said = prefill_workspace(str(checkpoints[mix]))
    ws = load(checkpoints[mix], lane="cuda", ctx=DEFAULT_CTX).lane.sized_workspace()
    assert (said["rows"], said["scratch_bytes"], said["cublas_config"], said["within"]) == (
        ws.rows, 2 * ws.scratch_values, ws.cublas_config, ws.within,
    )  # fmt: skip
    assert (said["share_bytes"], said["held_bytes"], said["rounds_in_place"]) == (
        ws.share_bytes, ws.held_bytes, ws.rounds_in_place,
    )  # fmt: skip


def test_a_mixture_sizes_its_scratch_at_its_own_chunk(checkpoints):
    # a mixture's chunks take the routing's rows whatever the share holds, and its attention products the
    # scratch: the workspace is sized at those rows alone, so what it counts is what a chunk holds
    model, ws = _sized(checkpoints["mixture"])
    assert ws.rows == min(kernels.MOE_CHUNK_ROWS, CTX) and model.session().chunk == ws.rows


def test_the_caches_are_parts_of_one_buffer(checkpoints):
    # each cache a block of its own took up to ~0.9 MB more where the caching allocator handed a 1.1 MB cache a
    # 2 MB block (`CudaLane.make_caches`): one buffer, each cache at a part boundary, none overlapping
    lane = load(checkpoints["q4_k_m"], lane="cuda", ctx=CTX).lane
    lane.step(1)
    caches = list(lane.caches.values())
    assert len(caches) == 2 * 24 and len({c.untyped_storage().data_ptr() for c in caches}) == 1
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in caches)
    base = caches[0].untyped_storage().data_ptr()  # the buffer's own start: a host one need not be aligned
    assert all((start - base) % kernels.PART_ALIGN_BYTES == 0 for start, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    held = sum(c.numel() * c.element_size() for c in caches)
    assert lane.model_bytes() == lane.weights_bytes - lane.stored_surplus + held  # the layout's bytes: the share's

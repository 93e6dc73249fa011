"""The cuda lane's paged form compiled on a GPU (`pytest -m cuda`; skipped where there is none): batch equals
single, the batch step's logits within the lane's contract, seeded draws that repeat, and every block back.

Small synthetic models with the reference families' features (qwen2: q/k/v biases, its V product landing in the
cache as a part of the QKV GEMV; qwen3: q/k norms), two layers, heads of whole 32-value blocks so the int8
numerics run where the single-sequence step has them; and the tiny mixture of experts.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from fuselane.engine.batch import engine_for  # noqa: E402
from fuselane.engine.blocks import BlockPool, BlockTable  # noqa: E402
from fuselane.engine.cuda import CudaPaged  # noqa: E402
from fuselane.engine.lane import Work  # noqa: E402
from fuselane.engine.sequence import Event, Request  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.ops import Quantize  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY, Sampler, SamplingParams  # noqa: E402

CTX = 160
SHAPES = {
    "qwen2-q8_0": (Shape("qwen2", 256, 2, 8, 2, 32, 512, 1024, context=4096), "q8_0"),
    "qwen3-q4_k_m": (Shape("qwen3", 256, 2, 4, 2, 64, 768, 1024, context=4096), "q4_k_m"),
    "qwen3moe-q8_0": ("tiny-qwen3moe", "q8_0"),  # a mixture: each row routed to its own experts
}
# eight prompts of different lengths (one past several prefill chunks) and replies of different lengths
PROMPTS = [[3 + i for i in range(n)] for n in (1, 5, 9, 17, 33, 70, 2, 120)]
MAX_TOKENS = [12, 7, 20, 3, 16, 9, 25, 5]


@pytest.fixture(scope="module", params=list(SHAPES))
def path(request, tmp_path_factory):
    shape, mix = SHAPES[request.param]
    return write_synthetic(tmp_path_factory.mktemp("paged") / "m.gguf", shape, mix, seed=9)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run(model, prompts, max_tokens, sampling, *, max_seqs, chunk=32, cancel_after=None, overlap=True, blocks=None):
    """The engine over the model's paged lane: each sequence's tokens, and the engine after the run."""
    blocks = blocks or max_seqs * (CTX // 16)
    engine = engine_for(model, blocks=blocks, max_seqs=max_seqs, max_queue=len(prompts), chunk=chunk, overlap=overlap)
    events: dict[int, list[Event]] = {}
    ids = [
        engine.submit(Request(tuple(p), n, sampling), lambda e: events.setdefault(e.seq, []).append(e))
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    if cancel_after is not None:
        for _ in range(cancel_after):
            engine.step()
        for seq in ids[::3]:
            engine.cancel(seq)
    engine.run_until_idle()
    assert not any(e.error for evs in events.values() for e in evs)
    return [[t for e in events.get(seq, []) for t in e.tokens] for seq in ids], engine


@pytest.mark.parametrize("max_seqs", [8, 3], ids=["all-at-once", "joining-and-leaving"])
def test_batch_equals_single(path, max_seqs):
    """Greedy, at the dequantized numerics (the tightest contract): each sequence's tokens are its tokens alone
    on the cpu lane in f64."""
    gpu = load(path, lane="cuda", ctx=CTX, knobs=["activations=dequant"])
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    got, engine = run(gpu, PROMPTS, MAX_TOKENS, GREEDY, max_seqs=max_seqs)
    for tokens, prompt, n in zip(got, PROMPTS, MAX_TOKENS, strict=True):
        assert tokens == list(ref.generate_ids(ref.session(), prompt, max_tokens=n, sampling=GREEDY))
    assert engine.pool.used == 0
    steps = engine.lane.steps
    # rows ran together, in buckets no larger than max_seqs rounded up, and replayed their graphs
    assert 2 <= max(steps) <= (8 if max_seqs == 8 else 4) and any(s.graphs for s in steps.values())


@pytest.mark.parametrize("max_seqs", [8, 3], ids=["all-at-once", "joining-and-leaving"])
def test_overlap_gives_the_tokens_of_no_overlap(path, max_seqs):
    """Compiled, the graphs replayed: the overlapped decode (a step launched before the tokens of the one before
    are read, its inputs advanced on the device) gives every sequence the tokens it gets without overlap,
    greedy and seeded, sequences joining and leaving; with a cancel mid-run; in a pool of one context, where
    sequences are preempted. At the dequantized numerics, where each row's tokens are its own alone whatever
    the batch (`test_batch_equals_single`), as overlap changes a step's rows where a sequence ends."""
    gpu = load(path, lane="cuda", ctx=CTX, knobs=["activations=dequant"])
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3)
    for sampling in (GREEDY, seeded):
        plain, _ = run(gpu, PROMPTS, MAX_TOKENS, sampling, max_seqs=max_seqs, overlap=False)
        over, engine = run(gpu, PROMPTS, MAX_TOKENS, sampling, max_seqs=max_seqs)
        assert over == plain and engine.pool.used == 0 and engine.lane.overlap
    plain, _ = run(gpu, PROMPTS, MAX_TOKENS, GREEDY, max_seqs=max_seqs, overlap=False, blocks=CTX // 16)
    over, engine = run(gpu, PROMPTS, MAX_TOKENS, GREEDY, max_seqs=max_seqs, blocks=CTX // 16)
    assert over == plain and engine.pool.used == 0
    assert max_seqs == 3 or engine.stats.preemptions > 0
    # every third sequence cancelled after six steps: overlap reads a step's tokens a step or more later (a
    # step that launches one reads none), so those have a prefix of their tokens; the others run to their ends
    plain, _ = run(gpu, PROMPTS, MAX_TOKENS, seeded, max_seqs=max_seqs, cancel_after=6, overlap=False)
    over, engine = run(gpu, PROMPTS, MAX_TOKENS, seeded, max_seqs=max_seqs, cancel_after=6)
    for i, (a, b) in enumerate(zip(over, plain, strict=True)):
        n = min(len(a), len(b))
        assert a == b if i % 3 else a[:n] == b[:n], f"sequence {i}"
    assert engine.pool.used == 0


@pytest.mark.parametrize("knobs", [[], ["activations=dequant"]], ids=["int8", "dequant"])
def test_batch_logits_within_contract(path, knobs):
    """One decode step of five sequences (a bucket of 8), of one, and of twelve (a bucket of 16): each row's
    logits within the lane's contract of the cpu lane's alone. Under int8 activations the first two read int8
    rows where the single-sequence step does (the bucket of 8 through the int8 GEMV over its rows, `q8_rows`,
    after its `Quantize` launches); the bucket of 16 multiplies as a chunk does, on the f16 tensor cores."""
    gpu = load(path, lane="cuda", ctx=CTX, knobs=knobs)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    paged, pool = CudaPaged(gpu.lane, 64, 16), BlockPool(64, 16)
    prompts = PROMPTS[1:6] + [[40 + i, 7 * i + 1, 3] for i in range(7)]
    tables = [BlockTable() for _ in prompts]
    for seq, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        assert pool.grow(t, len(p))
        if len(p) > 1:
            paged.step([Work(seq, tuple(p[:-1]), 0, t, None)])
    for rows in (prompts[:5], prompts[:1], prompts):
        works = [Work(s, (p[-1],), len(p) - 1, tables[s], Sampler(GREEDY)) for s, p in enumerate(rows)]
        tokens = paged.step(works)
        logits = paged.steps[1 << (len(rows) - 1).bit_length()].logits[: len(rows)].float().cpu().numpy()
        for i, p in enumerate(rows):
            want = ref.session().feed(p)
            assert np.isfinite(logits[i]).all() and rel(logits[i], want) <= tol, f"row {i} of {len(rows)}"
            assert tokens[i] == int(np.argmax(logits[i]))
    quantized = any(isinstance(op.sym, Quantize) for op in paged.steps[8].plan.ops)
    assert quantized is (not knobs)  # the dequantized numerics quantize nothing
    assert not any(isinstance(op.sym, Quantize) for op in paged.steps[16].plan.ops)  # its products read f32


def test_draws_inside_the_graph_are_the_one_row_samplers(path):
    """A sampling row (top-k off: the one-row sampler's own tile over the whole row) beside a greedy one, step
    after step, eager and then replayed from the captured graph: each draw is the one `sample_token` makes from
    that step's logits with the sequence's generator at that step's counter; the greedy row takes the arg-max."""
    from fuselane.lanes.cuda.triton import sample

    gpu = load(path, lane="cuda", ctx=CTX)
    paged, pool = CudaPaged(gpu.lane, 8, 16), BlockPool(8, 16)
    p = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, seed=7)
    tables, fed = [BlockTable(), BlockTable()], [5, 9]
    seed = int(np.random.SeedSequence(p.seed).generate_state(1, np.uint64).view(np.int64)[0])
    vocab = gpu.cfg.vocab
    for pos in range(6):  # past the bucket's warm-up runs: the last steps replay its sampling graph
        assert all(pool.grow(t, pos + 1) for t in tables)
        works = [Work(0, (fed[0],), pos, tables[0], Sampler(p)), Work(1, (fed[1],), pos, tables[1], Sampler(GREEDY))]
        fed = paged.step(works)
        logits = paged.steps[2].logits[:2].clone()
        vals = torch.empty(vocab, dtype=torch.float32, device=logits.device)
        idx = torch.empty(vocab, dtype=torch.int64, device=logits.device)
        sample.candidates(logits[0], vals, idx)
        params = torch.tensor([p.temperature, p.top_p], dtype=torch.float32, device=logits.device)
        rng = torch.tensor([seed, pos], dtype=torch.int64, device=logits.device)
        picked = sample.new_picked(logits.device)
        sample.sample_token(vals, idx, params, rng, picked)
        assert fed == [int(picked[sample.TOKEN]), int(torch.argmax(logits[1]))], f"step {pos}"
    assert True in paged.steps[2].graphs


def test_seeded_draws_repeat_and_blocks_come_back(path):
    """Each sequence draws from its own seeded generator: the same batch twice gives the same tokens, another
    seed others. Sequences cancelled mid-run give their blocks back with the rest."""
    gpu = load(path, lane="cuda", ctx=CTX)
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3)
    first, _ = run(gpu, PROMPTS, MAX_TOKENS, sampled, max_seqs=8)
    again, _ = run(gpu, PROMPTS, MAX_TOKENS, sampled, max_seqs=8)
    other, _ = run(gpu, PROMPTS, MAX_TOKENS, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=4), max_seqs=8)
    assert first == again and first != other
    _, engine = run(gpu, PROMPTS, [CTX] * len(PROMPTS), sampled, max_seqs=5, cancel_after=6)
    assert engine.pool.used == 0 and engine.stats.kv_blocks_used == 0 and engine.scheduler.idle


def test_generate_batch_runs_on_the_gpu(path):
    gpu = load(path, lane="cuda", ctx=CTX, knobs=["activations=dequant"])
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    prompts = ["hello", "a longer prompt than the first", "x"]
    assert gpu.generate_batch(prompts, max_tokens=6, raw=True) == ref.generate_batch(prompts, max_tokens=6, raw=True)


def test_the_pool_is_sized_after_the_first_chunks_copies(path):
    """Asking the device's memory (what `fuselane serve` sizes the pool from) runs one chunk first, so the f16
    copies a chunk's products make are already made then: the paged form's chunks afterwards make none."""
    model = load(path, lane="cuda", ctx=CTX)
    assert not model.lane._dense
    memory = CudaPaged.device_memory(model.lane)
    made = set(model.lane._dense)
    assert made and memory.used <= memory.total
    run(model, PROMPTS[:3], MAX_TOKENS[:3], GREEDY, max_seqs=2, chunk=CTX)
    assert set(model.lane._dense) == made


def test_a_warmed_engine_builds_and_captures_nothing_while_it_serves(path):
    """After `Engine.warm` (what `fuselane serve` runs before it listens) every batch size up to max_seqs' has
    both graphs captured and every chunk size its step, so serving the prompts builds no step and captures no
    graph; the sequences' tokens are those of a run without the warm-up (which touched no sequence's blocks)."""
    knobs = ["activations=dequant"]  # as test_batch_equals_single: tokens that repeat across engines
    cold, _ = run(load(path, lane="cuda", ctx=CTX, knobs=knobs), PROMPTS, MAX_TOKENS, GREEDY, max_seqs=8)
    gpu = load(path, lane="cuda", ctx=CTX, knobs=knobs)
    engine = engine_for(gpu, blocks=8 * (CTX // 16), max_seqs=8, max_queue=len(PROMPTS), chunk=32)
    assert engine.warm() == 4 + 6  # buckets 1, 2, 4, 8; chunks 1, 2, 4, 8, 16, 32
    paged = engine.lane
    captured = {rows: set(step.graphs) for rows, step in paged.steps.items()}
    assert all(graphs == {False, True} for graphs in captured.values())
    chunks = set(paged.single._steps)
    events: dict[int, list[Event]] = {}
    ids = [
        engine.submit(Request(tuple(p), n, GREEDY), lambda e: events.setdefault(e.seq, []).append(e))
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    engine.run_until_idle()
    assert [[t for e in events[seq] for t in e.tokens] for seq in ids] == cold
    assert {rows: set(step.graphs) for rows, step in paged.steps.items()} == captured
    assert set(paged.single._steps) == chunks and engine.pool.used == 0

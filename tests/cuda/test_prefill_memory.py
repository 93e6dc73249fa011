"""What a model takes on the GPU through a prefill and decode under `prefill=int8` and `auto` (the default,
which takes `f16-scratch` for a sequence's prompt): the file's matrices as stored, its norms and biases, its KV
cache, and a workspace of at most 5 % more (`pytest -m cuda`; skipped without a GPU).

A Qwen2.5-7B-shaped Q4_K_M checkpoint (all 28 layers: the workspace is one chunk's live activations, the same
at any depth, set against the whole model's bytes) prefills a 512-token prompt in the session's chunks and
decodes 8 tokens; `torch.cuda.max_memory_allocated` over that, less what the process held before the load
(other tests' models in the same worker), must stay within 5 % of the weights and caches the lane holds.
Before the int8 prefill the f16 copies of the matrices alone were 3.6x the Q4_K bytes. Under `prefill=f16-scratch`
no copy is kept either, and the prompt's logits are the copies' within the contract.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.run.workspace import CUBLAS_CONFIG  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY  # noqa: E402
from fuselane.runtime.session import Session  # noqa: E402

PROMPT, GENERATED, CTX = 512, 8, 1024
ROOT = Path(__file__).resolve().parents[2]
CHILD_SECONDS = 300
WORKSPACE = 0.05  # of the weights and caches


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("7b") / "7b.gguf", "qwen2.5-7b", "q4_k_m", seed=3)


@pytest.mark.xdist_group("prefill-7b")
@pytest.mark.parametrize("knob", ["prefill=int8", "prefill=auto"])
def test_memory_is_the_file_the_cache_and_a_small_workspace(path, knob):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load(path, lane="cuda", ctx=CTX, knobs=[knob])
    session = model.session()
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab, size=PROMPT).tolist()
    session.feed(tokens)
    steps = model.lane.decode(tokens[-1], len(session.tokens), GREEDY)
    for _ in range(GENERATED):
        next(steps)
    steps.close()
    torch.cuda.synchronize()
    lane = model.lane
    held = sum(w.numel() for w, _ in lane.raw.values()) + sum(v.numel() * 4 for v in lane.vec.values())
    held += sum(c.numel() * c.element_size() for c in lane.caches.values())
    assert not lane._dense, "a product made an f16 copy"
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= held * (1 + WORKSPACE), f"peak {peak / 1e9:.2f} GB over {held / 1e9:.2f} GB + 5 %"


@pytest.mark.xdist_group("prefill-7b")
def test_the_f16_scratch_keeps_no_copy_and_multiplies_as_the_copies(path):
    # `prefill=f16-scratch`: the same f16 values and cuBLAS products as the copies, each matrix decoded into one
    # scratch just before its product; the prompt's logits within the contract of the copies' at one chunk
    tokens = np.random.default_rng(1).integers(0, 151936, size=PROMPT).tolist()
    logits = {}
    for knob in ("prefill=f16-copy", "prefill=f16-scratch"):
        model = load(path, lane="cuda", ctx=CTX, knobs=[knob])
        logits[knob] = Session(model.lane, chunk=PROMPT).feed(tokens)
        copies, scratch = bool(model.lane._dense), model.lane.f16_scratch()
        tol = model.lane.shim.numerics().logits_tolerance(model.cfg.n_layers)
        model.close()
    assert not copies and scratch is not None
    a, b = logits["prefill=f16-scratch"], logits["prefill=f16-copy"]
    assert np.isfinite(a).all() and np.max(np.abs(a - b)) <= tol * np.max(np.abs(b))


@pytest.mark.parametrize(
    ("shape", "mix", "rows"),
    [
        ("qwen3-0.6b", "q8_0", 512),
        ("qwen2.5-1.5b", "q4_k_m", 512),
        ("qwen2.5-0.5b", "q4_k_m_05b", 512),  # the pair in slabs, no cuBLAS workspace
        ("qwen2.5-0.5b", "q2_k", 256),  # a 512-row chunk's arena leaves the share too little
        ("qwen2.5-1.5b", "q2_k", 256),
    ],
)
def test_a_small_models_scratch_keeps_its_workspace_within_the_share(tmp_path, shape, mix, rows):
    # a small model's fixed workspace (the chunk's arena, cuBLAS's, a layer's gated pair in f16) was 10-14 % of
    # its file: the lane sizes its scratch to the share that is left (`run/workspace`), in chunks of fewer rows
    # where a 512-row chunk's arena leaves too little, and the whole model, its prompt in the session's chunks
    # and its decode steps, stays within it. Each model loads in a process of its own, as one a user starts: a
    # process whose cuBLAS workspace an earlier lane set leaves the lane no leaner one, and then the 1.5B in
    # Q2_K (its Q3_K matrices' stored layout holds 3.5 MB of the share) cannot hold it
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=3)
    env = {k: v for k, v in os.environ.items() if k != CUBLAS_CONFIG}
    code = (
        "import json, sys; from tests.cuda.test_prefill_memory import measure; print(json.dumps(measure(sys.argv[1])))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=CHILD_SECONDS)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["within"] and got["rows"] == got["chunk"] == rows, got
    assert got["peak"] <= got["held"] * (1 + WORKSPACE), (
        f"peak {got['peak'] / 1e9:.3f} GB over {got['held'] / 1e9:.3f} GB + 5 %"
    )


def measure(path: str) -> dict:
    """In a process of its own: the model at `path` prefills a prompt in its session's chunks and decodes; what its
    workspace held and the peak it took over the weights and caches."""
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load(path, lane="cuda", ctx=PROMPT + 2 * GENERATED)
    session = model.session()
    session.feed(np.random.default_rng(0).integers(0, model.cfg.vocab, size=PROMPT).tolist())
    steps = model.lane.decode(session.tokens[-1], len(session.tokens), GREEDY)
    for _ in range(GENERATED):
        next(steps)
    steps.close()
    torch.cuda.synchronize()
    lane = model.lane
    held = lane.weights_bytes + sum(c.numel() * c.element_size() for c in lane.caches.values())
    ws = lane.workspace
    got = dict(within=ws is not None and ws.within, rows=ws.rows if ws else None, chunk=session.chunk,
               peak=torch.cuda.max_memory_allocated() - before, held=held)  # fmt: skip
    model.close()
    return got

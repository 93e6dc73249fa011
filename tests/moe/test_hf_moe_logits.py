"""The cpu lane's logits on mixtures against Hugging Face transformers' `Qwen3MoeForCausalLM` (top-k
renormalised, no shared expert) and `Qwen2MoeForCausalLM` (top-k as the softmax gives it, a shared expert
under its sigmoid gate), on the same random weights written to GGUF: prefill, decode steps, and a prompt fed
in chunks.

Near-ties: which experts a row keeps is a discrete choice, so if the k-th and (k+1)-th router scores of some
row were within rounding of each other, f32 summation order alone could pick a different expert on each side.
The routers' weights are drawn wide (`ROUTER_SCALE`) and every test first asserts that, over every row and
layer of the sequence it compares, the k-th score leads the (k+1)-th by at least `MIN_GAP`, far above the
f32 difference between the two implementations' scores (measured: at most 5e-6, on scores about 10 in size):
a failure there means the seed drew a near-tie, not that routing is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from fuselane.gguf.synth import write_weights  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.reference.hf_moe import moe_shape, moe_weights, router_gaps, tiny_moe  # noqa: E402
from tests.reference.hf_tiny import greedy, greedy_from, hf_logits  # noqa: E402

# f32 on both sides, summed in different orders: the dense comparison's bound (tests/test_hf_logits.py).
REL_TOL = 1e-4
MIN_GAP = 1e-3
PROMPT = [5, 17, 101, 42, 42, 300, 7, 250, 3]
DECODE_STEPS = 4
CHUNK = 4  # three chunks of the nine-token prompt


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=["qwen2moe", "qwen3moe"])
def pair(request, tmp_path_factory):
    arch = request.param
    hf = tiny_moe(arch)
    path = write_weights(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", moe_shape(hf, arch), moe_weights(hf))
    model = load(path, lane="cpu", ctx=64)
    yield arch, hf, model
    model.close()


def test_the_file_says_what_the_model_is(pair):
    arch, hf, model = pair
    cfg = model.cfg
    assert (cfg.arch, cfg.experts, cfg.experts_used, cfg.expert_ff) == (arch, 8, 2, 32)
    assert cfg.renorm == hf.config.norm_topk_prob
    assert cfg.shared_ff == (48 if arch == "qwen2moe" else 0)


def test_prefill_logits_match_transformers(pair):
    arch, hf, model = pair
    assert router_gaps(hf, PROMPT) >= MIN_GAP
    assert rel_err(model.logits(PROMPT), hf_logits(hf, PROMPT)) <= REL_TOL


def test_decode_steps_match_transformers(pair):
    arch, hf, model = pair
    ids, ours = greedy(model, PROMPT, DECODE_STEPS)
    assert router_gaps(hf, ids) >= MIN_GAP
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"{arch} step {step}"


@st.composite
def mixtures(draw) -> dict:
    """A tiny mixture of widths the fixed one does not have: 2 to 16 experts, 1 to all of them kept, any expert
    width, qwen2moe's shared expert of any width, one to three layers, one to four key/value heads."""
    experts = draw(st.integers(2, 16))
    kv = draw(st.sampled_from([1, 2, 4]))
    return dict(
        arch=draw(st.sampled_from(["qwen2moe", "qwen3moe"])), experts=experts, kept=draw(st.integers(1, experts)),
        expert_ff=8 * draw(st.integers(1, 12)), shared_ff=8 * draw(st.integers(1, 16)), layers=draw(st.integers(1, 3)),
        kv_heads=kv, heads=kv * draw(st.sampled_from([1, 2, 4])), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=mixtures())
def test_any_mixture_matches_transformers(config, tmp_path):
    """Mixtures past the fixed ones (every expert kept, one kept, a lone key/value head): the prompt and greedy
    steps against Hugging Face's classes, where no row's routing is a near-tie (the draw is skipped then)."""
    arch = config["arch"]
    hf = tiny_moe(arch, **{k: v for k, v in config.items() if k != "arch"})
    path = write_weights(tmp_path / f"{arch}-{config['seed']}.gguf", moe_shape(hf, arch), moe_weights(hf))
    ids, ours = greedy_from(path, PROMPT, DECODE_STEPS)
    kept_all = config["kept"] == config["experts"]  # nothing dropped: no tie can change what is kept
    assume(kept_all or router_gaps(hf, ids) >= MIN_GAP)
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"{arch} step {step}"


def test_a_prompt_of_several_chunks_matches_transformers(pair):
    arch, hf, model = pair
    session = model.session()
    session.chunk = CHUNK
    assert len(PROMPT) > CHUNK
    assert rel_err(session.feed(PROMPT), hf_logits(hf, PROMPT)[-1]) <= REL_TOL

"""The cpu lane's logits on Qwen3-Next against Hugging Face transformers' `Qwen3NextForCausalLM` on the same
random weights written to GGUF as llama.cpp's converter writes them (tests.reference.hf_qwen3next): both layer
kinds (gated delta-rule and gated full attention, partial rotary), a prompt longer than one chunk of the
chunked rule, a prompt fed in several chunks, then decode steps, within 1e-4 relative in f32.

Hugging Face runs a prompt through its chunked rule (chunks of 64) and a cached step through its recurrence;
the cpu lane picks the same forms, so both of each are compared. Routing near-ties are excluded as in
tests/moe: every row's k-th router score leads the (k+1)-th by at least `MIN_GAP`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import torch  # noqa: E402

from fuselane.gguf.synth import write_weights  # noqa: E402
from fuselane.lanes.cpu.gdn_kernels import CHUNK  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.reference.hf_moe import router_gaps  # noqa: E402
from tests.reference.hf_qwen3next import gguf_weights, shape_of, tiny_qwen3next  # noqa: E402
from tests.reference.hf_tiny import hf_logits  # noqa: E402

REL_TOL = 1e-4  # f32 on both sides, summed in different orders (tests/test_hf_logits.py's bound)
MIN_GAP = 1e-3
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 384, CHUNK + 16)]  # past one chunk
STEPS = [7, 300, 42, 5]  # fed one at a time after the prompt
PIECES = 3  # the prompt fed in this many chunks of the session


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_qwen3next()
    path = write_weights(tmp_path_factory.mktemp("q3n") / "qwen3next.gguf", shape_of(hf), gguf_weights(hf))
    model = load(path, lane="cpu", ctx=128)
    ids = PROMPT + STEPS
    assert router_gaps(hf, ids) >= MIN_GAP
    yield hf, model, hf_logits(hf, ids)
    model.close()


def test_the_file_says_what_the_model_is(pair):
    hf, model, _ = pair
    cfg = model.cfg
    assert cfg.arch == "qwen3next" and cfg.linear is not None
    assert cfg.linear.layers == tuple(t == "linear_attention" for t in hf.config.layer_types)
    assert (cfg.rope_dim, cfg.experts, cfg.experts_used, cfg.shared_ff, cfg.renorm) == (8, 4, 2, 32, True)


def test_prefill_logits_match_transformers(pair):
    _, model, ref = pair
    assert rel_err(model.logits(PROMPT), ref[: len(PROMPT)]) <= REL_TOL


def test_decode_steps_match_transformers(pair):
    _, model, ref = pair
    session = model.session()
    ours = [session.feed(PROMPT)] + [session.extend([t]) for t in STEPS]
    for step, (a, b) in enumerate(zip(ours, ref[len(PROMPT) - 1 :], strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"step {step}"


def test_a_prompt_of_several_chunks_matches_transformers(pair):
    _, model, ref = pair
    session = model.session()
    session.chunk = -(-len(PROMPT) // PIECES)
    assert rel_err(session.feed(PROMPT), ref[len(PROMPT) - 1]) <= REL_TOL


def test_transformers_cached_steps_agree_with_its_own_prompt_pass(pair):
    """The reference is itself consistent: its recurrence (cached steps) gives its chunked pass's logits."""
    hf, _, ref = pair
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT]), use_cache=True)
        cache, steps = out.past_key_values, []
        for t in STEPS:
            out = hf(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.past_key_values  # the cache it returns, whatever it is called
            steps.append(out.logits[0, -1].double().numpy())
    assert rel_err(np.stack(steps), ref[len(PROMPT) :]) <= REL_TOL


@st.composite
def hybrids(draw) -> dict:
    """A tiny Qwen3-Next of widths the fixed one does not have: a full attention every one to three layers over
    two to four layers, one or two key heads of the rule with one to three value heads each, heads of 8 to 32
    values, convolutions of two to four taps, a quarter to all of a head turned, two to eight experts, any
    kept, one or two full-attention key heads."""
    experts = draw(st.integers(2, 8))
    k_heads, kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    full_every = draw(st.integers(1, 3))
    return dict(  # at least one full attention layer (Hugging Face's cache wants one)
        full_every=full_every, layers=draw(st.integers(max(2, full_every), 4)),
        head_dim=draw(st.sampled_from([16, 32])),
        k_heads=k_heads, v_heads=k_heads * draw(st.integers(1, 3)), ssm_dim=draw(st.sampled_from([8, 16, 32])),
        rope_part=draw(st.sampled_from([0.25, 0.5, 1.0])), linear_conv_kernel_dim=draw(st.integers(2, 4)),
        num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
        moe_intermediate_size=8 * draw(st.integers(1, 6)), shared_expert_intermediate_size=8 * draw(st.integers(1, 6)),
        num_key_value_heads=kv, num_attention_heads=kv * draw(st.integers(1, 2)), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=hybrids())
def test_any_hybrid_matches_transformers(config, tmp_path):
    """A prompt past one chunk of the rule, then cached steps, of Qwen3-Next shapes past the fixed one against
    Hugging Face's class, where no row's routing is a near-tie (the draw is skipped then)."""
    hf = tiny_qwen3next(**config)
    ids = PROMPT + STEPS
    kept_all = config["num_experts_per_tok"] == config["num_experts"]
    assume(kept_all or router_gaps(hf, ids) >= MIN_GAP)
    path = write_weights(tmp_path / f"q3n-{config['seed']}.gguf", shape_of(hf), gguf_weights(hf))
    model = load(path, lane="cpu", ctx=128)
    try:
        session = model.session()
        ours = [session.feed(PROMPT)] + [session.extend([t]) for t in STEPS]
    finally:
        model.close()
    for step, (a, b) in enumerate(zip(ours, hf_logits(hf, ids)[len(PROMPT) - 1 :], strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"step {step}"

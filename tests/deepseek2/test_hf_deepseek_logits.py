"""The cpu lane's logits on deepseek2 files against Hugging Face transformers' `DeepseekV2ForCausalLM` (softmax
routing, weights scaled; with and without q LoRA) and `DeepseekV3ForCausalLM` (sigmoid routing with the
correction bias, grouped top-k, weights renormalised and scaled, YaRN), on the same random weights written to
GGUF as llama.cpp's converter writes them: prefill, decode steps, and a prompt fed in chunks, in f32.

The two sides compute latent attention in different forms (Hugging Face expands the latent into each head's
keys and values; the file is run absorbed), so agreement also checks the absorption. Near-ties: every test
first asserts that each kept expert (and kept group) leads the best one left out by `MIN_GAP`, far above the
f32 difference of the two sides' scores, so a routing flip by rounding cannot decide a test.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from fuselane.gguf.synth import write_weights  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.reference.hf_deepseek import choice_margins, latent_shape, latent_weights, tiny_deepseek  # noqa: E402
from tests.reference.hf_tiny import greedy, greedy_from, hf_logits  # noqa: E402

REL_TOL = 1e-4  # f32 on both sides, summed in different orders: the dense comparison's bound
MIN_GAP = 1e-4
PROMPT = [5, 17, 101, 42, 42, 300, 7, 250, 3]
DECODE_STEPS = 3
CHUNK = 4
CASES = {"v2": (2, False), "v2-q-lora": (2, True), "v3": (3, True)}


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    version, q_lora = CASES[request.param]
    hf = tiny_deepseek(version, q_lora=q_lora)
    path = write_weights(tmp_path_factory.mktemp(request.param) / "m.gguf", latent_shape(hf, version),
                         latent_weights(hf))  # fmt: skip
    model = load(path, lane="cpu", ctx=64)
    yield request.param, hf, model
    model.close()


def test_the_file_says_what_the_model_is(pair):
    name, hf, model = pair
    lt, c = model.cfg.latent, hf.config
    assert (lt.q_lora, lt.kv_lora, lt.nope, lt.rope, lt.vdim) == (
        c.q_lora_rank or 0, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)  # fmt: skip
    assert (lt.dense_layers, model.cfg.experts, model.cfg.experts_used) == (1, 8, 2)
    assert lt.weights_scale == c.routed_scaling_factor
    assert (lt.groups > 1, lt.bias, lt.yarn is not None, model.cfg.renorm) == (name == "v3",) * 4
    assert model.cfg.cache_values == c.kv_lora_rank + c.qk_rope_head_dim


def test_prefill_logits_match_transformers(pair):
    _, hf, model = pair
    assert choice_margins(hf, PROMPT) >= MIN_GAP
    assert rel_err(model.logits(PROMPT), hf_logits(hf, PROMPT)) <= REL_TOL


def test_decode_steps_match_transformers(pair):
    name, hf, model = pair
    ids, ours = greedy(model, PROMPT, DECODE_STEPS)
    assert choice_margins(hf, ids) >= MIN_GAP
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"{name} step {step}"


def test_a_prompt_of_several_chunks_matches_transformers(pair):
    _, hf, model = pair
    session = model.session()
    session.chunk = CHUNK
    assert rel_err(session.feed(PROMPT), hf_logits(hf, PROMPT)[-1]) <= REL_TOL


@st.composite
def latents(draw) -> dict:
    """A tiny DeepSeek of widths the fixed ones do not have: one to eight heads, the latent, the heads' key and
    value halves and the q LoRA (or none) of other widths, 2 to 12 experts (V3's in one to four groups of two
    to four, fewer groups kept than there are), any kept, one or two shared experts, a dense first layer or
    none, another routing scale."""
    version = draw(st.sampled_from([2, 3]))
    groups = draw(st.sampled_from([1, 2, 4])) if version == 3 else 1
    experts = groups * draw(st.integers(2, 4)) if version == 3 else draw(st.integers(2, 12))
    kept_groups = draw(st.integers(1, max(1, groups - 1)))
    widths = dict(
        num_attention_heads=draw(st.sampled_from([1, 2, 4, 8])), kv_lora_rank=16 * draw(st.integers(1, 4)),
        qk_nope_head_dim=8 * draw(st.integers(1, 4)), qk_rope_head_dim=draw(st.sampled_from([8, 16, 32])),
        v_head_dim=8 * draw(st.integers(1, 4)), n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, kept_groups * experts // groups)),
        moe_intermediate_size=8 * draw(st.integers(1, 8)), n_shared_experts=draw(st.integers(1, 2)),
        first_k_dense_replace=draw(st.integers(0, 1)), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
    )  # fmt: skip
    if version == 3:
        widths |= dict(n_group=groups, topk_group=kept_groups)
    q_lora = draw(st.sampled_from([0, 16, 48]))
    return dict(version=version, q_lora=q_lora, layers=draw(st.integers(2, 3)), seed=draw(st.integers(0, 2**16)),
                widths=widths)  # fmt: skip


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=latents())
def test_any_latent_model_matches_transformers(config, tmp_path):
    """The prompt and greedy steps of DeepSeek shapes past the fixed ones against Hugging Face's classes, where
    no row's routing is a near-tie (the draw is skipped then)."""
    version = config["version"]
    hf = tiny_deepseek(version, q_lora=config["q_lora"], seed=config["seed"], layers=config["layers"],
                       **config["widths"])  # fmt: skip
    path = write_weights(tmp_path / f"m-{config['seed']}.gguf", latent_shape(hf, version), latent_weights(hf))
    ids, ours = greedy_from(path, PROMPT, DECODE_STEPS)
    assume(choice_margins(hf, ids) >= MIN_GAP)
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"v{version} step {step}"

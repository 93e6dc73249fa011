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

pytest.importorskip("transformers")

from fuselane.gguf.synth import write_weights  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.reference.hf_deepseek import choice_margins, latent_shape, latent_weights, tiny_deepseek  # noqa: E402
from tests.reference.hf_tiny import hf_logits  # noqa: E402

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
    session = model.session()
    ids = list(PROMPT)
    ours = [session.feed(ids)]
    for _ in range(DECODE_STEPS):
        ids.append(int(np.argmax(ours[-1])))
        ours.append(session.extend(ids[-1:]))
    assert choice_margins(hf, ids) >= MIN_GAP
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"{name} step {step}"


def test_a_prompt_of_several_chunks_matches_transformers(pair):
    _, hf, model = pair
    session = model.session()
    session.chunk = CHUNK
    assert rel_err(session.feed(PROMPT), hf_logits(hf, PROMPT)[-1]) <= REL_TOL

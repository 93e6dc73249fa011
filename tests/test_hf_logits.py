"""The cpu lane's logits against Hugging Face transformers' own Qwen2/Qwen3 classes on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from fuselane.gguf.synth import write_weights  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.reference.hf_tiny import gguf_weights, greedy, hf_logits, shape_of, tiny_hf  # noqa: E402

# f32 on both sides; the two sum in different orders, so logits agree to a few f32 ulps times the depth.
REL_TOL = 1e-4
PROMPT = [5, 17, 101, 42, 42, 300, 7, 250, 3]
DECODE_STEPS = 6


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(params=["qwen2", "qwen3"])
def pair(request, tmp_path):
    arch = request.param
    hf = tiny_hf(arch)
    path = write_weights(tmp_path / f"{arch}.gguf", shape_of(hf, arch), gguf_weights(hf))
    model = load(path, lane="cpu", ctx=64)
    yield arch, hf, model
    model.close()


def test_prefill_logits_match_transformers(pair):
    arch, hf, model = pair
    assert rel_err(model.logits(PROMPT), hf_logits(hf, PROMPT)) <= REL_TOL


def decode_matches(model, hf, arch: str) -> None:
    """The prompt, then DECODE_STEPS greedy steps, each step's logits against Hugging Face's on the same ids."""
    ids, ours = greedy(model, PROMPT, DECODE_STEPS)
    ref = hf_logits(hf, ids)[len(PROMPT) - 1 :]
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) <= REL_TOL, f"{arch} step {step}"


def test_decode_steps_match_transformers(pair):
    arch, hf, model = pair
    decode_matches(model, hf, arch)


def test_chunked_prefill_equals_whole(pair, tmp_path):
    arch, hf, model = pair
    session = model.session()
    session.chunk = 4  # three chunks of the nine-token prompt
    chunked = session.feed(PROMPT)
    assert rel_err(chunked, hf_logits(hf, PROMPT)[-1]) <= REL_TOL


def test_tied_embeddings(tmp_path):
    hf = tiny_hf("qwen3", tied=True, seed=3)
    path = write_weights(tmp_path / "tied.gguf", shape_of(hf, "qwen3"), gguf_weights(hf))
    with_tied = load(path, lane="cpu", ctx=32)
    assert with_tied.cfg.tied
    assert rel_err(with_tied.logits(PROMPT), hf_logits(hf, PROMPT)) <= REL_TOL


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_matches_transformers(arch, tmp_path):
    # `rope.scaling.type` yarn: the frequencies stretched by the ramp between the betas over the original
    # context (a short one, so the tiny heads' frequencies fall on both sides of it), and the rotation's cos and
    # sin scaled by 1 + 0.1 ln(factor), as Hugging Face's yarn rope and llama.cpp read it; prefill then decode
    hf = tiny_hf(arch, seed=5, yarn=(4.0, 64))
    path = write_weights(tmp_path / "yarn.gguf", shape_of(hf, arch), gguf_weights(hf))
    model = load(path, lane="cpu", ctx=64)
    assert model.cfg.yarn is not None and model.cfg.yarn.factor == 4.0 and model.cfg.score_scale > 1
    decode_matches(model, hf, arch)
    # the same weights read without the stretch are another model: the test sees the difference
    plain = load(write_weights(tmp_path / "plain.gguf", shape_of(tiny_hf(arch, seed=5), arch), gguf_weights(hf)),
                 lane="cpu", ctx=64)  # fmt: skip
    assert rel_err(plain.logits(PROMPT), hf_logits(hf, PROMPT)) > 100 * REL_TOL


@st.composite
def hf_shapes(draw) -> dict:
    """A tiny Qwen2 or Qwen3 config of widths no other test names: one to eight key/value heads, one to four
    query heads each, heads of 8 to 96 values (Qwen2's the hidden width over the heads), an FFN of any width,
    one to three layers, tied or not, another rotary base and norm epsilon."""
    arch = draw(st.sampled_from(["qwen2", "qwen3"]))
    kv = draw(st.integers(1, 8))
    heads = kv * draw(st.integers(1, 4))
    hd = 2 * draw(st.integers(4, 48))  # even: the rotation turns pairs
    hidden = heads * hd if arch == "qwen2" else 16 * draw(st.integers(2, 12))
    return dict(
        arch=arch, layers=draw(st.integers(1, 3)), tied=draw(st.booleans()), hidden=hidden, heads=heads,
        kv_heads=kv, head_dim=hd, ff=8 * draw(st.integers(2, 40)), rope_theta=draw(st.sampled_from([1e4, 1e6, 5e6])),
        eps=draw(st.sampled_from([1e-6, 1e-5])), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=hf_shapes())
def test_any_qwen_shape_matches_transformers(config, tmp_path):
    """Shapes past the fixed tiny ones (a head as wide as the hidden width, a lone key/value head, an odd FFN,
    one layer, a tied head): the prompt's logits and greedy steps against Hugging Face's classes."""
    arch = config["arch"]
    hf = tiny_hf(arch, **{k: v for k, v in config.items() if k != "arch"})
    path = write_weights(tmp_path / f"{arch}-{config['seed']}.gguf", shape_of(hf, arch), gguf_weights(hf))
    model = load(path, lane="cpu", ctx=64)
    try:
        decode_matches(model, hf, arch)
    finally:
        model.close()

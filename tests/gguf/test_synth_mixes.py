"""llama.cpp's quantization mixes in `fuselane.gguf.synth`: each matrix's format as `llama_tensor_get_type`
chooses it (tables written out here by hand from llama.cpp's rules), and every mix written, read back and run
on the cpu lane."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import LlamaFileType

from fuselane.gguf.formats import Format
from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import SHAPES, Mix, Shape, tensor_formats, tensor_shapes, write_synthetic

# rows of whole super-blocks and 4 query heads a kv head, so the K formats and the gqa >= 4 rules both show;
# 16 layers so the first sixteenth / eighth rules pick layer 0 / layers 0-1
K_SHAPE = Shape("qwen2", 256, 16, 4, 1, 64, 512, 300, context=1024)
RUN_SHAPE = Shape("qwen3", 256, 2, 4, 1, 64, 512, 300, context=256)
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# the 7B's use_more_bits layers (n = 28: n/8 = 3, 7n/8 = 24)
MORE_28 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}


def by_layer(formats: dict[str, Format], kind: str, n: int) -> list[Format]:
    return [formats[f"blk.{i}.{kind}.weight"] for i in range(n)]


def expect(formats, n, base, embd=None, output=Format.Q6_K, **kinds):
    """Each kind's formats by layer: `kinds[kind]` (a list, or a function of the layer) or `base`."""
    assert formats["token_embd.weight"] is (embd or base)
    assert formats["output.weight"] is output
    for kind in KINDS:
        want = kinds.get(kind, base)
        want = [want(i) for i in range(n)] if callable(want) else [want] * n if isinstance(want, Format) else want
        assert by_layer(formats, kind, n) == want, kind
    assert {f for name, f in formats.items() if not name.endswith(".weight") or "norm" in name} == {Format.F32}


def test_q5_k_m_on_7b():
    f = tensor_formats(SHAPES["qwen2.5-7b"], "q5_k_m")
    more = lambda i: Format.Q6_K if i in MORE_28 else Format.Q5_K  # noqa: E731
    expect(f, 28, Format.Q5_K, attn_v=more, ffn_down=more)


def test_q6_k_and_q8_0_are_uniform_with_their_output():
    expect(tensor_formats(SHAPES["qwen2.5-7b"], "q6_k"), 28, Format.Q6_K)
    expect(tensor_formats(SHAPES["qwen2.5-7b"], "q8_0"), 28, Format.Q8_0, output=Format.Q8_0)


def test_q4_0_and_q5_0_keep_a_q6_k_output():
    expect(tensor_formats(SHAPES["qwen3-8b"], "q4_0"), 36, Format.Q4_0)
    expect(tensor_formats(SHAPES["qwen3-8b"], "q5_0"), 36, Format.Q5_0)
    # the 0.5B's 896-value rows are whole 32-value blocks but not super-blocks: the output falls back to Q8_0
    expect(tensor_formats(SHAPES["qwen2.5-0.5b"], "q4_0"), 24, Format.Q4_0, output=Format.Q8_0)


def test_q3_k_m_on_7b():
    # attn_v Q5_K on the first two layers; ffn_down Q5_K on the first 28 // 16 = 1; attn_output Q4_K
    f = tensor_formats(SHAPES["qwen2.5-7b"], "q3_k_m")
    expect(f, 28, Format.Q3_K, attn_v=lambda i: Format.Q5_K if i < 2 else Format.Q4_K,
           attn_output=Format.Q4_K, ffn_down=lambda i: Format.Q5_K if i < 1 else Format.Q4_K)  # fmt: skip


def test_q2_k_by_query_heads_a_kv_head():
    # attn_v: Q4_K with 4+ query heads a kv head (the 7B's 7, the 8B's 4), else Q3_K (the 0.6B's 2)
    for name, n, v in (("qwen2.5-7b", 28, Format.Q4_K), ("qwen3-8b", 36, Format.Q4_K), ("qwen3-0.6b", 28, Format.Q3_K)):
        f = tensor_formats(SHAPES[name], "q2_k")
        expect(f, n, Format.Q2_K, attn_v=v, attn_output=Format.Q3_K, ffn_down=Format.Q3_K)


def test_iq4_xs():
    # attn_v Q5_K with 4+ query heads a kv head; ffn_down Q5_K on the first eighth (28 // 8 = 3 layers)
    f = tensor_formats(SHAPES["qwen2.5-7b"], "iq4_xs")
    expect(f, 28, Format.IQ4_XS, attn_v=Format.Q5_K, ffn_down=lambda i: Format.Q5_K if i < 3 else Format.IQ4_XS)
    f = tensor_formats(SHAPES["qwen3-0.6b"], "iq4_xs")
    expect(f, 28, Format.IQ4_XS, ffn_down=lambda i: Format.Q5_K if i < 3 else Format.IQ4_XS)


def test_the_grid_recipes_on_7b():
    # IQ3_M: IQ3_S; attn_v and attn_output Q4_K, ffn_down Q4_K on the first eighth; the embedding the base's
    f = tensor_formats(SHAPES["qwen2.5-7b"], "iq3_m")
    first = lambda fmt, base: lambda i: fmt if i < 3 else base  # noqa: E731
    expect(f, 28, Format.IQ3_S, attn_v=Format.Q4_K, attn_output=Format.Q4_K, ffn_down=first(Format.Q4_K, Format.IQ3_S))
    # IQ3_XXS (with an importance matrix): q and k IQ2_S, attn_v Q4_K (7 query heads a kv head), attn_output
    # IQ3_S; the embedding IQ3_S, the output Q5_K
    f = tensor_formats(SHAPES["qwen2.5-7b"], "iq3_xxs")
    expect(f, 28, Format.IQ3_XXS, embd=Format.IQ3_S, output=Format.Q5_K, attn_q=Format.IQ2_S, attn_k=Format.IQ2_S,
           attn_v=Format.Q4_K, attn_output=Format.IQ3_S)  # fmt: skip
    # and with 2 query heads a kv head (the 0.6B) the base's attn_v
    f = tensor_formats(SHAPES["qwen3-0.6b"], "iq3_xxs")
    expect(f, 28, Format.IQ3_XXS, embd=Format.IQ3_S, output=Format.Q5_K, attn_q=Format.IQ2_S, attn_k=Format.IQ2_S,
           attn_output=Format.IQ3_S)  # fmt: skip
    # IQ2_M: IQ2_S; attn_v Q4_K with 4+ query heads a kv head, else IQ3_S; attn_output IQ3_S; ffn_down IQ3_S on
    # the first eighth; the embedding IQ3_S, the output Q5_K
    for name, v in (("qwen2.5-7b", Format.Q4_K), ("qwen3-0.6b", Format.IQ3_S)):
        f = tensor_formats(SHAPES[name], "iq2_m")
        expect(f, 28, Format.IQ2_S, embd=Format.IQ3_S, output=Format.Q5_K, attn_v=v, attn_output=Format.IQ3_S,
               ffn_down=first(Format.IQ3_S, Format.IQ2_S))  # fmt: skip
    # a mixture's experts (Qwen3-30B-A3B, 128 of them): IQ2_M's attn_v Q4_K whatever the heads
    f = tensor_formats(SHAPES["qwen3-30b-a3b"], "iq2_m")
    assert f["blk.0.attn_v.weight"] is Format.Q4_K and f["blk.9.ffn_gate_exps.weight"] is Format.IQ2_S


def test_mxfp4_moe_is_the_experts_in_mxfp4_and_every_other_matrix_q8_0():
    # llama.cpp's MXFP4_MOE: a 3-D (expert) tensor MXFP4, every other matrix Q8_0, the output too; the router F32
    f = tensor_formats(SHAPES["qwen3-30b-a3b"], "mxfp4_moe")
    experts = {n for n in f if "_exps." in n}
    assert experts and {f[n] for n in experts} == {Format.MXFP4}
    assert {f[n] for n in f if n not in experts and n.endswith(".weight") and "norm" not in n} - {Format.F32} == {
        Format.Q8_0
    }
    assert f["blk.0.ffn_gate_inp.weight"] is Format.F32 and f["output.weight"] is Format.Q8_0
    # a dense model has no expert tensor: every matrix Q8_0
    expect(tensor_formats(SHAPES["qwen2.5-7b"], "mxfp4_moe"), 28, Format.Q8_0, output=Format.Q8_0)


def test_bf16_is_every_matrix():
    f = tensor_formats(SHAPES["qwen3-8b"], "bf16")
    assert {f[n] for n, d in tensor_shapes(SHAPES["qwen3-8b"]).items() if len(d) == 2} == {Format.BF16}


def test_32b_shape():
    s = SHAPES["qwen2.5-32b"]
    assert (s.arch, s.n_embd, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.n_ff, s.vocab) == (
        "qwen2",
        5120,
        64,
        40,
        8,
        128,
        27648,
        151936,
    )
    # use_more_bits at n = 64: i < 8, i >= 56, or (i - 8) % 3 == 2
    more = {i for i in range(64) if i < 8 or i >= 56 or (i - 8) % 3 == 2}
    f = tensor_formats(s, "q4_k_m")
    k4 = lambda i: Format.Q6_K if i in more else Format.Q4_K  # noqa: E731
    expect(f, 64, Format.Q4_K, attn_v=k4, ffn_down=k4)
    assert tensor_shapes(s)["blk.63.ffn_down.weight"] == (5120, 27648)


FILE_TYPES = {
    "bf16": LlamaFileType.MOSTLY_BF16, "q6_k": LlamaFileType.MOSTLY_Q6_K, "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M,
    "q4_0": LlamaFileType.MOSTLY_Q4_0, "q5_0": LlamaFileType.MOSTLY_Q5_0, "iq4_xs": LlamaFileType.MOSTLY_IQ4_XS,
    "q3_k_m": LlamaFileType.MOSTLY_Q3_K_M, "q2_k": LlamaFileType.MOSTLY_Q2_K, "iq3_m": LlamaFileType.MOSTLY_IQ3_M,
    "iq3_xxs": LlamaFileType.MOSTLY_IQ3_XXS, "iq2_m": LlamaFileType.MOSTLY_IQ2_M,
}  # fmt: skip
BASES = {"iq3_m": Format.IQ3_S, "iq2_m": Format.IQ2_S}  # the mixes named for a recipe, not their base format


@pytest.mark.parametrize("mix", list(FILE_TYPES))
def test_written_file_holds_the_recipe(tmp_path, mix):
    path = write_synthetic(tmp_path / "m.gguf", K_SHAPE, mix)
    want = tensor_formats(K_SHAPE, mix)
    with open_gguf(path) as g:
        assert g.metadata["general.file_type"] == FILE_TYPES[mix]
        assert {n: t.format for n, t in g.tensors.items()} == want
    # at whole super-blocks nothing falls back: the base format and the recipe's others are what is written
    base = want["blk.5.ffn_gate.weight"]
    assert base is (BASES[mix] if mix in BASES else Format[mix.removesuffix("_m").upper()])


@pytest.mark.parametrize("mix", [m.value for m in Mix])
def test_every_mix_runs_on_the_cpu_lane(tmp_path, mix):
    from fuselane import load

    model = load(write_synthetic(tmp_path / "m.gguf", RUN_SHAPE, mix, seed=2), lane="cpu", ctx=16)
    logits = model.logits([1, 5, 9, 200])
    assert logits.shape == (4, RUN_SHAPE.vocab) and np.all(np.isfinite(logits))
    assert np.ptp(logits[-1]) > 0

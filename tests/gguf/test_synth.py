"""Synthetic GGUF checkpoints: recipes, metadata, tensor tables, determinism, the tokenizer, given weights."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from fuselane.errors import FuselaneError
from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import Format
from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import (
    SHAPES,
    Mix,
    Shape,
    main,
    tensor_formats,
    tensor_shapes,
    tensor_type_overrides,
    write_synthetic,
    write_weights,
)
from fuselane.gguf.synth_recipes import use_more_bits
from fuselane.gguf.synth_vocab import SPECIAL_TOKENS, byte_symbols, synthetic_tokenizer

TINY = ("tiny-qwen2", "tiny-qwen3")
# a small shape whose rows are whole 256-value super-blocks, so the K formats are really written
K_SHAPE = Shape("qwen3", 256, 3, 4, 2, 64, 512, 300, context=1024)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def layers_with(formats: dict[str, Format], kind: str, fmt: Format) -> set[int]:
    return {int(n.split(".")[1]) for n, f in formats.items() if n.endswith(f".{kind}.weight") and f is fmt}


def test_real_shapes_are_the_anchors():
    rows = {
        "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864),
        "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 128, 3072),
        "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 128, 18944),
        "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 128, 12288),
    }
    for name, row in rows.items():
        s = SHAPES[name]
        assert (s.arch, s.n_embd, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.n_ff) == row
        assert s.vocab == 151936 and not s.tied


@pytest.mark.parametrize("mix", list(Mix))
@pytest.mark.parametrize("name", TINY)
def test_tiny_files_read_back(tmp_path, name, mix):
    shape = SHAPES[name]
    path = write_synthetic(tmp_path / "m.gguf", name, mix, seed=1)
    with open_gguf(path) as g:
        meta, a = g.metadata, shape.arch
        assert meta["general.architecture"] == a
        assert meta[f"{a}.block_count"] == shape.n_layers
        assert meta[f"{a}.embedding_length"] == shape.n_embd
        assert meta[f"{a}.feed_forward_length"] == shape.n_ff
        assert meta[f"{a}.attention.head_count"] == shape.n_heads
        assert meta[f"{a}.attention.head_count_kv"] == shape.n_kv_heads
        assert meta[f"{a}.context_length"] == shape.context
        assert meta[f"{a}.rope.freq_base"] == pytest.approx(shape.rope_base)
        assert meta[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(shape.rms_eps)
        # head size: always stated by qwen3; qwen2 here has head_dim == n_embd / heads, so leaves it out
        assert (f"{a}.attention.key_length" in meta) == (a == "qwen3")
        if a == "qwen3":
            assert meta[f"{a}.attention.key_length"] == meta[f"{a}.attention.value_length"] == shape.head_dim
        assert len(meta["tokenizer.ggml.tokens"]) == shape.vocab
        formats, shapes = tensor_formats(shape, mix), tensor_shapes(shape)
        assert list(g.tensors) == list(formats) == list(shapes)
        for t in g.tensors.values():
            assert (t.format, t.shape) == (formats[t.name], shapes[t.name]), t.name
            values = dequantize(t.data, t.format, t.shape)
            assert np.all(np.isfinite(values)), t.name
            if t.name.endswith("norm.weight"):
                assert 0.5 < values.mean() < 1.5
            elif len(t.shape) == 2:
                assert 0.005 < values.std() < 0.08, t.name


def test_qwen2_states_head_size_when_it_is_not_n_embd_over_heads(tmp_path):
    shape = dataclasses.replace(SHAPES["tiny-qwen2"], head_dim=32)
    with open_gguf(write_synthetic(tmp_path / "m.gguf", shape, "f16")) as g:
        assert g.metadata["qwen2.attention.key_length"] == 32
        assert g.tensors["blk.0.attn_q.weight"].shape == (128, 64)
        assert g.tensors["blk.0.attn_output.weight"].shape == (64, 128)


def test_k_formats_are_written_and_decode_to_weight_sized_values(tmp_path):
    path = write_synthetic(tmp_path / "k.gguf", K_SHAPE, "q4_k_m")
    with open_gguf(path) as g:
        assert g.metadata["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        used = {t.format for t in g.tensors.values()}
        assert {Format.Q4_K, Format.Q6_K} <= used
        for t in g.tensors.values():
            if t.format in (Format.Q4_K, Format.Q6_K):
                values = dequantize(t.data, t.format, t.shape)
                assert 0.01 < values.std() < 0.04 and abs(values.mean()) < 0.005, t.name


def test_use_more_bits_is_llama_cpp_rule():
    # i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, integer division: for 28 layers n/8 = 3 and 7n/8 = 24,
    # for 36 layers n/8 = 4 and 7n/8 = 31
    more_28 = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    more_36 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
    assert [i for i in range(28) if use_more_bits(i, 28)] == more_28
    assert [i for i in range(36) if use_more_bits(i, 36)] == more_36


def test_q4_k_m_recipe_on_7b():
    shape = SHAPES["qwen2.5-7b"]
    f = tensor_formats(shape, Mix.Q4_K_M)
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}
    for kind in ("attn_v", "ffn_down"):
        assert layers_with(f, kind, Format.Q6_K) == more
        assert layers_with(f, kind, Format.Q4_K) == set(range(28)) - more
    for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert layers_with(f, kind, Format.Q4_K) == set(range(28))
    assert f["token_embd.weight"] is Format.Q4_K and f["output.weight"] is Format.Q6_K
    assert {f[n] for n, d in tensor_shapes(shape).items() if len(d) == 1} == {Format.F32}
    assert f["blk.3.attn_q.bias"] is Format.F32


def test_q4_k_m_falls_back_as_llama_cpp_when_rows_are_not_super_blocks():
    shape = SHAPES["qwen2.5-0.5b"]  # n_embd 896 = 3.5 super-blocks; n_ff 4864 = 19
    f = tensor_formats(shape, "q4_k_m")
    more = {i for i in range(24) if use_more_bits(i, 24)}
    assert layers_with(f, "attn_v", Format.Q8_0) == more  # Q6_K -> Q8_0
    assert layers_with(f, "attn_v", Format.Q5_0) == set(range(24)) - more  # Q4_K -> Q5_0
    assert layers_with(f, "ffn_down", Format.Q6_K) == more  # rows of 4864: K formats fit
    assert f["token_embd.weight"] is Format.Q5_0 and f["output.weight"] is Format.Q8_0


def test_05b_mix_is_the_real_files():
    shape = SHAPES["qwen2.5-0.5b"]
    f = tensor_formats(shape, Mix.Q4_K_M_05B)
    # the real file's layers, counted by llama-quantize in name order (0, 1, 10, ..., 19, 2, 20, ...)
    more = {0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21}
    assert layers_with(f, "attn_v", Format.Q8_0) == more
    assert layers_with(f, "attn_v", Format.Q5_0) == set(range(24)) - more
    assert layers_with(f, "ffn_down", Format.Q6_K) == more
    assert layers_with(f, "ffn_down", Format.Q4_K) == set(range(24)) - more
    for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert layers_with(f, kind, Format.Q5_0) == set(range(24))
    assert f["token_embd.weight"] is Format.Q5_0 and f["output.weight"] is Format.Q8_0


def test_05b_mix_matches_the_real_file(request):
    pytest.importorskip("fuselane.hub")
    with open_gguf(request.getfixturevalue("qwen_gguf")) as real:
        shape = SHAPES["qwen2.5-0.5b"]
        formats, shapes = tensor_formats(shape, Mix.Q4_K_M_05B), tensor_shapes(shape)
        assert {n: (t.format, t.shape) for n, t in real.tensors.items()} == {n: (formats[n], shapes[n]) for n in shapes}


def test_real_05b_file_writes_with_the_right_table(tmp_path):
    # 0.49 GB, about two seconds; deleted at the end so pytest's kept tmp folders stay small
    shape = SHAPES["qwen2.5-0.5b"]
    path = write_synthetic(tmp_path / "05b.gguf", "qwen2.5-0.5b", "q4_k_m_05b")
    try:
        with open_gguf(path) as g:
            formats, shapes = tensor_formats(shape, Mix.Q4_K_M_05B), tensor_shapes(shape)
            assert {n: (t.format, t.shape) for n, t in g.tensors.items()} == {
                n: (formats[n], shapes[n]) for n in shapes
            }
            assert g.tensors["token_embd.weight"].shape == (151936, 896)
            assert g.tensors["blk.23.ffn_down.weight"].shape == (896, 4864)
            assert g.tensors["blk.0.attn_k.weight"].shape == (128, 896)
            assert sum(t.nbytes for t in g.tensors.values()) == 485_452_288  # the real file's tensor bytes
            assert len(g.metadata["tokenizer.ggml.merges"]) == 151936 - 259
    finally:
        path.unlink()


def test_tied_shapes_have_no_output_and_quantize_the_embedding_as_output():
    tied = dataclasses.replace(K_SHAPE, tied=True)
    assert "output.weight" not in tensor_shapes(tied)
    assert tensor_formats(tied, "q4_k_m")["token_embd.weight"] is Format.Q6_K
    assert tensor_formats(K_SHAPE, "q4_k_m")["token_embd.weight"] is Format.Q4_K
    tiny_tied = dataclasses.replace(SHAPES["tiny-qwen2"], tied=True)
    assert tensor_formats(tiny_tied, "q4_k_m")["token_embd.weight"] is Format.Q8_0


def test_same_seed_same_bytes(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "tiny-qwen3", "q4_k_m", seed=7)
    b = write_synthetic(tmp_path / "b.gguf", "tiny-qwen3", "q4_k_m", seed=7)
    c = write_synthetic(tmp_path / "c.gguf", "tiny-qwen3", "q4_k_m", seed=8)
    assert sha(a) == sha(b) != sha(c)
    assert not list(tmp_path.glob("*.partial"))


def test_bad_inputs_are_fuselane_errors(tmp_path):
    with pytest.raises(FuselaneError, match="unknown shape"):
        write_synthetic(tmp_path / "x.gguf", "qwen9-1t")
    with pytest.raises(FuselaneError, match="unknown mix"):
        write_synthetic(tmp_path / "x.gguf", "tiny-qwen2", "q3_k_xl")
    with pytest.raises(FuselaneError, match="does not exist"):
        write_synthetic(tmp_path / "no" / "x.gguf", "tiny-qwen2")
    with pytest.raises(FuselaneError, match="group evenly"):
        Shape("qwen2", 64, 2, 4, 3, 16, 128, 512)
    with pytest.raises(FuselaneError, match="architecture"):
        Shape("llama", 64, 2, 4, 2, 16, 128, 512)
    with pytest.raises(FuselaneError, match="259"):
        write_synthetic(tmp_path / "x.gguf", dataclasses.replace(SHAPES["tiny-qwen2"], vocab=100))
    assert not list(tmp_path.iterdir())


# --- the tokenizer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [259, 260, 512, 151936])
def test_tokenizer_is_consistent(vocab):
    meta = synthetic_tokenizer(vocab)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == len(set(tokens)) == vocab
    assert tuple(tokens[:256]) == byte_symbols() and len(set(byte_symbols())) == 256
    assert tokens[220] == "\N{LATIN CAPITAL LETTER G WITH DOT ABOVE}"  # GPT-2's space symbol at its id
    assert tuple(tokens[-3:]) == SPECIAL_TOKENS and types[-3:] == [3, 3, 3] and set(types[:-3]) == {1}
    assert meta["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.padding_token_id"]
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    merges = meta.get("tokenizer.ggml.merges", [])
    assert len(merges) == vocab - 259
    rank = {t: i for i, t in enumerate(tokens)}
    for i, merge in enumerate(merges):
        left, right = merge.split(" ")
        # both pieces exist before the merge that uses them, and the merge makes the next token
        assert rank[left] < 256 + i and rank[right] < 256 + i
        assert tokens[256 + i] == left + right


def test_tokenizer_is_seeded():
    assert synthetic_tokenizer(600, seed=1) == synthetic_tokenizer(600, seed=1)
    assert synthetic_tokenizer(600, seed=1) != synthetic_tokenizer(600, seed=2)


def test_bpe_rebuilds_every_merged_token():
    tokenizers = pytest.importorskip("tokenizers")
    meta = synthetic_tokenizer(4000, seed=3)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    for token in tokens[256:-3]:
        assert [t.value for t in bpe.tokenize(token)] == [token]


def test_transformers_reads_the_tokenizer_and_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_synthetic(tmp_path / "t.gguf", "tiny-qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Hello there, ünïcode!"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- given weights ------------------------------------------------------------------------------------------


def random_weights(shape: Shape, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(d).astype(np.float32) for n, d in tensor_shapes(shape).items()}


@pytest.mark.parametrize("name", TINY)
def test_write_weights_f32_round_trips_exactly(tmp_path, name):
    shape = SHAPES[name]
    weights = random_weights(shape)
    with open_gguf(write_weights(tmp_path / "w.gguf", shape, weights)) as g:
        assert g.metadata["general.file_type"] == 0  # ALL_F32
        assert list(g.tensors) == list(weights)
        for n, t in g.tensors.items():
            assert t.format is Format.F32
            np.testing.assert_array_equal(dequantize(t.data, t.format, t.shape), weights[n])


def test_write_weights_q8_0_within_quantization_error(tmp_path):
    shape = dataclasses.replace(SHAPES["tiny-qwen3"], tied=True)
    weights = random_weights(shape, seed=5)
    formats = {n: Format.Q8_0 for n, d in tensor_shapes(shape).items() if len(d) == 2}
    tok = synthetic_tokenizer(shape.vocab, seed=9)
    with open_gguf(write_weights(tmp_path / "w.gguf", shape, weights, formats, tokenizer=tok)) as g:
        assert g.metadata["general.file_type"] == 7  # MOSTLY_Q8_0
        assert g.metadata["tokenizer.ggml.merges"] == tok["tokenizer.ggml.merges"]
        assert "output.weight" not in g.tensors
        for n, t in g.tensors.items():
            got, want = dequantize(t.data, t.format, t.shape), weights[n]
            if n not in formats:
                np.testing.assert_array_equal(got, want)
                continue
            assert t.format is Format.Q8_0
            # Q8_0 rounds each value to a step of its 32-block's max |value| / 127 (half a step off at most),
            # and stores the step as f16 (up to 127 codes times 2^-11 of a step more)
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(got - want).reshape(-1, 32) <= (0.5 + 127 * 2**-11) * step + 1e-7), n


def test_write_weights_checks_names_and_shapes(tmp_path):
    shape = SHAPES["tiny-qwen2"]
    weights = random_weights(shape)
    with pytest.raises(FuselaneError, match="missing"):
        write_weights(tmp_path / "w.gguf", shape, {n: w for n, w in weights.items() if "blk.1." not in n})
    with pytest.raises(FuselaneError, match="shape"):
        write_weights(tmp_path / "w.gguf", shape, weights | {"output_norm.weight": np.ones(3, np.float32)})
    with pytest.raises(FuselaneError, match="whole Q4_K blocks"):
        write_weights(tmp_path / "w.gguf", shape, weights, {"blk.0.attn_norm.weight": Format.Q4_K})
    with pytest.raises(FuselaneError, match="Q4_K"):  # rows fit, but quantize cannot make K blocks
        write_weights(tmp_path / "w.gguf", K_SHAPE, random_weights(K_SHAPE), {"blk.0.ffn_up.weight": Format.Q4_K})
    with pytest.raises(FuselaneError, match="tokens"):
        write_weights(tmp_path / "w.gguf", shape, weights, tokenizer=synthetic_tokenizer(300))
    assert not list(tmp_path.iterdir())


# --- command line -------------------------------------------------------------------------------------------


def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "c.gguf"
    assert main([str(out), "--shape", "tiny-qwen3", "--mix", "Q4_K_M", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{out.stat().st_size:,}" in printed
    assert sha(out) == sha(write_synthetic(tmp_path / "d.gguf", "tiny-qwen3", Mix.Q4_K_M, seed=3))


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "c.gguf"), "--shape", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown shape") and err.count("\n") == 1


def test_tensor_types_override_as_llama_quantizes(tmp_path):
    # the first pattern a matrix's name holds wins; a row that is not whole blocks falls back as llama.cpp's
    # does (64-value rows: a grid format to IQ4_NL, a ternary one to Q4_0); norms and biases stay F32
    out = tmp_path / "t.gguf"
    argv = [str(out), "--shape", "tiny-qwen3", "--mix", "q8_0", "--tensor-type", "ffn_(up|gate)=IQ3_S"]
    assert main([*argv, "--tensor-type", "attn_q=tq2_0", "--tensor-type", "ffn=q4_0"]) == 0
    wide = tensor_type_overrides(K_SHAPE, "q8_0", ["blk\\.1\\.ffn_up=iq2_xxs", "ffn_up=q4_k"])
    with open_gguf(out) as f:
        types = {name: t.format for name, t in f.tensors.items()}
    assert {types[f"blk.{i}.ffn_{p}.weight"] for i in range(2) for p in ("up", "gate")} == {Format.IQ4_NL}
    assert types["blk.0.attn_q.weight"] is Format.Q4_0 and types["blk.0.ffn_down.weight"] is Format.Q4_0
    assert types["blk.0.attn_k.weight"] is Format.Q8_0 and types["blk.0.attn_norm.weight"] is Format.F32
    assert wide == {"blk.1.ffn_up.weight": Format.IQ2_XXS, **{f"blk.{i}.ffn_up.weight": Format.Q4_K for i in (0, 2)}}


@pytest.mark.parametrize(
    ("pattern", "error"),
    [("q8_0", "is not REGEX=TYPE"), ("(=q8_0", "bad regular expression"), ("ffn=q8_k", "unknown type q8_k")],
)
def test_bad_tensor_types_are_one_line(tmp_path, capsys, pattern, error):
    assert main([str(tmp_path / "c.gguf"), "--tensor-type", pattern]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --tensor-type") and error in err and err.count("\n") == 1

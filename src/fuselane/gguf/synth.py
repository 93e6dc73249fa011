"""Write GGUF checkpoints of Qwen2/Qwen3 models (dense, or mixtures of experts) and of DeepSeek's deepseek2
(`synth_latent`) at any shape: random weights, or given float weights.

Why: tests need small checkpoints of every architecture and quantization mix, and GPU benchmarks need files in
the real models' shapes and mixes (decode speed does not depend on weight values) where no real file is at
hand. `write_synthetic` writes random blocks in a named mix (`tensor_formats` applies `synth_recipes`, llama.cpp's
recipes) with a synthetic tokenizer and ChatML template; `write_weights` writes given float weights (e.g. a
Hugging Face tiny model's, for logits comparisons), quantized to chosen formats.

Files are streamed: the header and tensor table go out first, then each tensor is generated and written in
chunks, so memory stays at one chunk however large the model. Each tensor's random data comes from a
generator seeded by (seed, tensor name), so the same seed gives the same bytes.

    python -m fuselane.gguf.synth OUT.gguf --shape qwen3-8b --mix q4_k_m [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from fuselane.errors import FuselaneError
from fuselane.gguf import synth_ffn as ffn
from fuselane.gguf import synth_qwen3next as hybrid
from fuselane.gguf.formats import LAYOUTS, Format, tensor_bytes
from fuselane.gguf.quantize import quantize, random_blocks
from fuselane.gguf.synth_latent import LatentShape
from fuselane.gguf.synth_latent import metadata as latent_metadata
from fuselane.gguf.synth_latent import tensor_shapes as latent_tensor_shapes
from fuselane.gguf.synth_recipes import (  # re-exported: the mixes and their rules are part of synth's API
    FILE_TYPES,
    FORMAT_FILE_TYPES,
    RECIPES,
    Mix,
    Recipe,
    fit_format,
    layer_ranks,
)
from fuselane.gguf.synth_shapes import (  # re-exported: the shapes are part of synth's API
    SHAPES,
    Shape,
    resolve_shape,
)
from fuselane.gguf.synth_vocab import synthetic_tokenizer

WEIGHT_SCALE = 0.02  # root-mean-square of random matrix weights, about that of trained transformer weights
NORM_JITTER = 0.1  # random RMS-norm weights are 1 +- this, so activations keep their size through the norms
CHUNK_BYTES = 64 << 20  # random data is generated and written this much at a time
QUANTIZATION_VERSION = 2  # ggml's current block layouts, as llama-quantize stamps them
UINT32_LIMIT = 1 << 32


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor's GGUF name and numpy-order shape (rows, row length), in the order files hold them."""
    if isinstance(shape, LatentShape):
        return latent_tensor_shapes(shape)
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, shape.n_embd)}
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        if shape.arch == hybrid.ARCH:
            out |= hybrid.layer_shapes(shape, b, i) | _moe_shapes(shape, b)
            continue
        out[b + "attn_norm.weight"] = (shape.n_embd,)
        out[b + "attn_q.weight"] = (q, shape.n_embd)
        out[b + "attn_k.weight"] = (kv, shape.n_embd)
        out[b + "attn_v.weight"] = (kv, shape.n_embd)
        if shape.family == "qwen2":
            out |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        else:
            out |= {b + "attn_q_norm.weight": (shape.head_dim,), b + "attn_k_norm.weight": (shape.head_dim,)}
        out[b + "attn_output.weight"] = (shape.n_embd, q)
        out[b + "ffn_norm.weight"] = (shape.n_embd,)
        out |= _moe_shapes(shape, b) if shape.moe else _dense_shapes(shape, b)
    out["output_norm.weight"] = (shape.n_embd,)
    if not shape.tied:
        out["output.weight"] = (shape.vocab, shape.n_embd)
    return out


def _dense_shapes(shape: Shape, b: str) -> dict[str, tuple[int, ...]]:
    return ffn.dense(b, shape.n_embd, shape.n_ff)


def _moe_shapes(shape: Shape, b: str) -> dict[str, tuple[int, ...]]:
    """A mixture layer's tensors as llama.cpp's converter writes them: 3-D experts, outermost first."""
    out = ffn.experts(b, shape.n_embd, shape.experts, shape.expert_ff)
    if shape.shared_ff:
        out |= ffn.shared_expert(b, shape.n_embd, shape.shared_ff, gated=True)
    return out


# --- the recipes (`synth_recipes`) applied to a shape ----------------------------------------------------


def _recipe_format(shape: Shape, recipe: Recipe, name: str, row: int, ranks: list[int]) -> Format:
    """The format `recipe` gives matrix `name` (rows of `row` values), before the row-size fallback."""
    # The output projection (the embedding table when tied) gets Q6_K, or Q8_0 straight away when its rows
    # are not whole blocks of the base format: llama.cpp special-cases it before the generic fallback.
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        if row % LAYOUTS[recipe.base].values or recipe.base is Format.Q8_0:
            return Format.Q8_0
        return recipe.output
    parts = name.split(".")
    if parts[0] != "blk":
        return (recipe.token_embd if name == "token_embd.weight" else None) or recipe.base
    rank, kind = ranks[int(parts[1])], parts[2]
    # llama.cpp's attn_v rules take every "attn_v-like" matrix (`category_is_attn_v`: a fused q/k/v one too,
    # Qwen3-Next's delta-rule layers'), counted over all of them: a layer holds one, so its rank
    if kind in ("attn_v", "attn_qkv"):
        chosen = recipe.attn_v(rank, shape.n_layers, shape.n_heads // shape.n_kv_heads, shape.experts)
    elif kind == "attn_output":
        chosen = recipe.attn_output
    elif kind in ("attn_q", "attn_k"):
        chosen = recipe.attn_q if kind == "attn_q" else recipe.attn_k
    elif kind in ("ffn_down", "ffn_down_exps", "ffn_down_shexp"):
        chosen = recipe.ffn_down(rank, shape.n_layers)
    else:
        chosen = None
    return chosen or recipe.base


# llama.cpp's converter keeps the router in F32 and llama-quantize never quantizes it.
ROUTER = "ffn_gate_inp.weight"

_PLAIN: dict[Mix, Format] = {Mix.F32: Format.F32, Mix.F16: Format.F16, Mix.BF16: Format.BF16}


def tensor_formats(shape: Shape, mix: Mix | str) -> dict[str, Format]:
    """Each tensor's storage format in `mix`, by GGUF name, in file order.

    1-D tensors (norms, biases) and routers are F32. F32 / F16 / BF16: every matrix in that format (llama-quantize does
    not requantize floats). The quantized mixes follow llama.cpp's recipe (`RECIPES`), e.g. Q4_K_M: embedding
    Q4_K; output Q6_K; attn_v and ffn_down Q6_K on the `use_more_bits` layers, Q4_K elsewhere; other matrices
    Q4_K. Q4_K_M_05B: the same with the real 0.5B file's layer count order (`layer_ranks`). Rows that are not
    whole blocks fall back as llama.cpp does (`fit_format`): e.g. at n_embd 896, Q4_K becomes Q5_0 and Q6_K
    becomes Q8_0.
    """
    mix = Mix.parse(mix)
    ranks = layer_ranks(shape.n_layers, mix)
    formats: dict[str, Format] = {}
    for name, dims in tensor_shapes(shape).items():
        if len(dims) == 1 or name.endswith((ROUTER, *hybrid.F32_MATRICES)):
            formats[name] = Format.F32
        elif mix in _PLAIN:
            formats[name] = _PLAIN[mix]
        elif len(dims) == 3 and RECIPES[mix].experts is not None:  # llama.cpp's `ne[2] > 1`
            formats[name] = fit_format(RECIPES[mix].experts, dims[-1])
        else:
            formats[name] = fit_format(_recipe_format(shape, RECIPES[mix], name, dims[-1], ranks), dims[-1])
    return formats


# --- writing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Planned:
    name: str
    dims: tuple[int, ...]
    fmt: Format
    nbytes: int


def _add_metadata(writer: GGUFWriter, key: str, value: Any) -> None:
    # GGUF keeps counts and token ids as uint32 and hyper-parameters as float32, as llama.cpp writes them
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < UINT32_LIMIT:
            writer.add_uint32(key, value)
        else:
            writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise FuselaneError(f"metadata '{key}' has a value of type {type(value).__name__} GGUF cannot hold")


def model_metadata(shape: Shape, name: str, file_type: int) -> dict[str, Any]:
    """The general.* and {arch}.* metadata of a checkpoint of `shape`, as llama.cpp's converter writes it."""
    a = shape.arch
    meta: dict[str, Any] = {
        "general.type": "model",
        "general.name": name,
        f"{a}.block_count": shape.n_layers,
        f"{a}.context_length": shape.context,
        f"{a}.embedding_length": shape.n_embd,
        f"{a}.feed_forward_length": shape.n_ff,
        f"{a}.attention.head_count": shape.n_heads,
        f"{a}.attention.head_count_kv": shape.n_kv_heads,
    }
    if isinstance(shape, LatentShape):
        meta |= latent_metadata(shape)
    elif shape.moe:
        meta |= {
            f"{a}.expert_count": shape.experts,
            f"{a}.expert_used_count": shape.experts_used,
            f"{a}.expert_feed_forward_length": shape.expert_ff,
        }
        if shape.shared_ff:
            meta[f"{a}.expert_shared_feed_forward_length"] = shape.shared_ff
    if a == hybrid.ARCH:
        meta |= hybrid.metadata(shape)
    # Qwen3 always states its head size; Qwen2 files only when it is not n_embd / heads, the reader's default.
    if isinstance(shape, Shape) and (shape.family == "qwen3" or shape.n_heads * shape.head_dim != shape.n_embd):
        meta[f"{a}.attention.key_length"] = shape.head_dim
        meta[f"{a}.attention.value_length"] = shape.head_dim
    if isinstance(shape, Shape) and shape.yarn_factor > 1:
        meta |= {
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(shape.yarn_factor),
            f"{a}.rope.scaling.original_context_length": shape.yarn_original or shape.context,
        }
    meta |= {
        f"{a}.rope.freq_base": float(shape.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(shape.rms_eps),
        "general.file_type": int(file_type),
        "general.quantization_version": QUANTIZATION_VERSION,
    }
    return meta


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, label: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda _n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _pad(f: Any, alignment: int) -> None:
    f.write(b"\0" * (-f.tell() % alignment))


def _write(
    path: str | os.PathLike[str],
    shape: Shape,
    plan: list[_Planned],
    metadata: Mapping[str, Any],
    chunks: Callable[[_Planned], Iterator[np.ndarray]],
    progress: bool,
) -> Path:
    """Stream a GGUF file: header, metadata and tensor table through GGUFWriter, then each tensor's chunks.

    Written to a '.partial' file renamed into place at the end, so a failed or interrupted write never leaves
    a file at `path` that looks like a checkpoint.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FuselaneError(f"cannot write {path}: folder {path.parent} does not exist")
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, shape.arch)
    for key, value in metadata.items():
        _add_metadata(writer, key, value)
    for t in plan:
        # shape in numpy order with a non-uint8 dtype: GGUFWriter takes it as elements and reverses it
        writer.add_tensor_info(t.name, t.dims, np.dtype(np.float32), t.nbytes, GGMLQuantizationType(int(t.fmt)))
    alignment = writer.data_alignment
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        total = sum(t.nbytes for t in plan)
        with open(partial, "ab") as f, _progress_bar(progress, total, f"writing {path.name}") as advance:
            # the tensor table gives offsets from the aligned data start, each tensor padded to the alignment
            _pad(f, alignment)
            for t in plan:
                written = 0
                for chunk in chunks(t):
                    chunk.tofile(f)
                    written += chunk.nbytes
                    advance(chunk.nbytes)
                if written != t.nbytes:
                    raise RuntimeError(f"{t.name}: wrote {written} bytes, the tensor table says {t.nbytes}")
                _pad(f, alignment)
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def _seeded(seed: int, name: str) -> np.random.Generator:
    # per tensor, so a tensor's bytes do not depend on which tensors come before it
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _random_chunks(t: _Planned, seed: int) -> Iterator[np.ndarray]:
    rng = _seeded(seed, t.name)
    if len(t.dims) == 1 and (special := hybrid.random_vector(t.name, t.dims[0], rng)) is not None:
        yield quantize(special, t.fmt)
        return
    if len(t.dims) == 1:  # norm weights near one, biases near zero
        is_norm = t.name.endswith("norm.weight")
        spread = np.float32(NORM_JITTER if is_norm else WEIGHT_SCALE)
        yield quantize(rng.standard_normal(t.dims[0], dtype=np.float32) * spread + np.float32(is_norm), t.fmt)
        return
    rows, row = int(np.prod(t.dims[:-1])), t.dims[-1]  # a 3-D expert tensor: every expert's rows in turn
    lay = LAYOUTS[t.fmt]
    blocks_per_row = row // lay.values
    rows_per_chunk = max(1, CHUNK_BYTES // (blocks_per_row * lay.nbytes))
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        yield random_blocks(t.fmt, n * blocks_per_row, rng, WEIGHT_SCALE).reshape(-1)


def write_synthetic(
    path: str | os.PathLike[str],
    shape: Shape | str,
    mix: Mix | str = "q8_0",
    *,
    seed: int = 0,
    progress: bool = False,
    formats: Mapping[str, Format] | None = None,
) -> Path:
    """Write a checkpoint of `shape` (a Shape or a SHAPES name) with random weights in `mix`; return its path.

    Matrices are random blocks of the formats `tensor_formats` gives (values of size ~0.02), norms near one,
    biases near zero; the tokenizer is `synthetic_tokenizer(shape.vocab, seed)`. `formats` stores the tensors
    it names in other formats than the mix's (a file no recipe writes: an MXFP4 matrix in a Q8_0 model). The
    same arguments give the same bytes. `progress` shows a progress bar on stderr. Memory stays at one 64 MiB
    chunk.
    """
    label, shape = resolve_shape(shape)
    mix = Mix.parse(mix)
    dims = tensor_shapes(shape)
    chosen = tensor_formats(shape, mix) | _named_formats(dims, formats)
    plan = [_Planned(n, dims[n], f, tensor_bytes(f, dims[n])) for n, f in chosen.items()]
    meta = model_metadata(shape, f"synthetic {label} {mix.value}", FILE_TYPES[mix])
    meta["general.description"] = f"fuselane synthetic checkpoint: random weights, mix {mix.value}, seed {seed}"
    meta |= _tokenizer(shape, None, seed)
    return _write(path, shape, plan, meta, lambda t: _random_chunks(t, seed), progress)


def tensor_type_overrides(shape: Shape | str, mix: Mix | str, patterns: Sequence[str]) -> dict[str, Format]:
    """The formats llama-quantize's `--tensor-type REGEX=TYPE` options give `shape`'s matrices in `mix`: each
    matrix the mix quantizes takes the type of the first pattern found in its name (`re.search`), or llama.cpp's
    fallback where its rows are not whole blocks of it (`fit_format`); norms, biases and routers stay F32.
    FuselaneError for a pattern without `=`, a bad regular expression or a type fuselane does not read."""
    _, shape = resolve_shape(shape)
    rules = []
    for pattern in patterns:
        regex, sep, name = pattern.rpartition("=")
        if not sep or not regex:
            raise FuselaneError(f"--tensor-type '{pattern}' is not REGEX=TYPE")
        try:
            rules.append((re.compile(regex), Format[name.upper()]))
        except re.error as e:
            raise FuselaneError(f"--tensor-type '{pattern}': bad regular expression: {e}") from None
        except KeyError:
            raise FuselaneError(
                f"--tensor-type '{pattern}': unknown type {name}: choose one of "
                f"{', '.join(f.name.lower() for f in Format)}"
            ) from None
    dims = tensor_shapes(shape)
    chosen: dict[str, Format] = {}
    for name, fmt in tensor_formats(shape, mix).items():
        if len(dims[name]) == 1 or name.endswith((ROUTER, *hybrid.F32_MATRICES)):
            continue
        rule = next((f for regex, f in rules if regex.search(name)), None)
        if rule is not None and rule is not fmt:
            chosen[name] = fit_format(rule, dims[name][-1])
    return chosen


def _named_formats(dims: Mapping[str, tuple[int, ...]], formats: Mapping[str, Format] | None) -> dict[str, Format]:
    """`formats` checked against the model's tensors: each one it has, its rows whole blocks of the format."""
    named = {n: Format(f) for n, f in (formats or {}).items()}
    unknown = [n for n in named if n not in dims]
    if unknown:
        raise FuselaneError(f"formats name tensors the model does not have: {unknown[:3]}")
    for name, fmt in named.items():
        if dims[name][-1] % LAYOUTS[fmt].values:
            raise FuselaneError(f"'{name}' rows of {dims[name][-1]} values are not whole {fmt.name} blocks")
    return named


def _tokenizer(shape: Shape, tokenizer: Mapping[str, Any] | None, seed: int = 0) -> dict[str, Any]:
    try:
        meta = dict(tokenizer) if tokenizer is not None else synthetic_tokenizer(shape.vocab, seed)
    except ValueError as e:
        raise FuselaneError(str(e)) from None
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != shape.vocab:
        raise FuselaneError(f"the tokenizer has {len(tokens)} tokens, the embedding table {shape.vocab} rows")
    return meta


def write_weights(
    path: str | os.PathLike[str],
    shape: Shape | str,
    weights: Mapping[str, np.ndarray],
    formats: Mapping[str, Format] | None = None,
    *,
    tokenizer: Mapping[str, Any] | None = None,
) -> Path:
    """Write given float weights, by GGUF tensor name in numpy order, as a checkpoint of `shape`.

    Every tensor of `tensor_shapes(shape)` must be given, at its shape, and nothing else. Each is stored in
    `formats[name]` (F32 where not named) via `quantize`, so F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 are
    possible. `tokenizer` is GGUF tokenizer metadata (default: the synthetic one). Returns the path.
    """
    label, shape = resolve_shape(shape)
    dims = tensor_shapes(shape)
    missing = [n for n in dims if n not in weights]
    extra = [n for n in weights if n not in dims]
    if missing or extra:
        raise FuselaneError(f"weights do not match the {shape.arch} tensors: missing {missing[:3]}, extra {extra[:3]}")
    named = _named_formats(dims, formats)
    plan: list[_Planned] = []
    for name, want in dims.items():
        got = tuple(np.shape(weights[name]))
        if got != want:
            raise FuselaneError(f"weight '{name}' has shape {got}, expected {want}")
        fmt = named.get(name, Format.F32)
        plan.append(_Planned(name, want, fmt, tensor_bytes(fmt, want)))
    matrix_formats = Counter({t.fmt: 0 for t in plan})
    for t in plan:
        if len(t.dims) > 1:
            matrix_formats[t.fmt] += int(np.prod(t.dims))
    file_type = FORMAT_FILE_TYPES.get(matrix_formats.most_common(1)[0][0], LlamaFileType.GUESSED)
    meta = model_metadata(shape, f"{label} weights", file_type) | _tokenizer(shape, tokenizer)

    def encode(t: _Planned) -> Iterator[np.ndarray]:
        yield quantize(np.asarray(weights[t.name], dtype=np.float32), t.fmt)

    return _write(path, shape, plan, meta, encode, progress=False)


# --- command line -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m fuselane.gguf.synth OUT.gguf --shape NAME --mix MIX [--seed N] [--tensor-type REGEX=TYPE ...]`:
    write a synthetic file."""
    parser = argparse.ArgumentParser(
        prog="python -m fuselane.gguf.synth", description="Write a synthetic Qwen or DeepSeek GGUF checkpoint."
    )
    parser.add_argument("out", help="path of the .gguf file to write")
    parser.add_argument("--shape", default="tiny-qwen2", help=f"one of: {', '.join(SHAPES)}")
    parser.add_argument("--mix", default="q8_0", help=f"one of: {', '.join(m.value for m in Mix)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and vocabulary")
    parser.add_argument(
        "--tensor-type",
        action="append",
        default=[],
        metavar="REGEX=TYPE",
        help="as llama-quantize's: matrices whose name REGEX finds in TYPE (e.g. 'ffn_(up|gate)=iq3_s'), repeatable",
    )
    args = parser.parse_args(argv)
    try:
        formats = tensor_type_overrides(args.shape, args.mix, args.tensor_type)
        path = write_synthetic(
            args.out, args.shape, args.mix, seed=args.seed, progress=sys.stderr.isatty(), formats=formats
        )
    except (FuselaneError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = path.stat().st_size
    print(f"{path} {size:,} bytes ({size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

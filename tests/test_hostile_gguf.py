"""Hostile GGUF metadata, end to end: counts the tensors do not back, and keys stored with the wrong type.

Each hostile file is the tiny qwen2 model with one metadata key replaced, written with an explicit GGUF type,
so the file is well-formed and only that claim is wrong. Every case must end, through `info`, `run` or
`tokenize`, in one `fuselane: error:` line naming the key, exit code 1, within seconds and under the 1.5 GiB
address-space bound of `tests.bounded`: a count that is believed before it is checked (a 2^31-layer table
built before the first comparison) shows up here as a timeout or a MemoryError instead of an error line.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf.constants import GGUFValueType

from fuselane.errors import FuselaneError, GgufError, ModelError
from fuselane.gguf.reader import check_layout
from fuselane.gguf.scan import (
    MAX_ARRAY_ELEMENTS,
    MAX_KV_COUNT,
    MAX_STRING_ELEMENTS,
    MAX_TENSOR_COUNT,
    MIN_TENSOR_INFO_BYTES,
)
from fuselane.gguf.synth import write_synthetic
from fuselane.info import describe
from fuselane.models.config import MAX_CONTEXT
from tests.bounded import assert_one_line_error, run_bounded
from tests.test_bad_input import _add, tiny_meta, tiny_weights

VT = GGUFValueType
ARCH = "qwen2"
U64_MAX = 2**64 - 1
BOUND_SECONDS = 1.0  # a refused count is refused before any loop over it


@dataclass(frozen=True, slots=True)
class Typed:
    """A metadata value with the GGUF type it is written as (and its elements' type, for an array)."""

    value: Any
    vtype: GGUFValueType
    sub: GGUFValueType | None = None


def write_with(path: Path, overrides: Mapping[str, Typed | None]) -> Path:
    """The tiny qwen2 model with each key of `overrides` written as that value and type instead (None: left out)."""
    writer = gguf.GGUFWriter(path, ARCH)
    for key, value in tiny_meta().items():
        if key not in overrides:
            _add(writer, key, value)
    for key, typed in overrides.items():
        if typed is not None:
            writer.add_key_value(key, typed.value, typed.vtype, typed.sub)
    for name, data in tiny_weights().items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True, slots=True)
class Case:
    overrides: dict[str, Typed]
    says: tuple[str, ...]  # fragments the one-line message must hold
    error: type[FuselaneError]
    commands: tuple[str, ...] = ("info",)


TOKENIZER_COMMANDS = ("info", "tokenize", "run")
COUNTS: dict[str, Case] = {
    "2^31 layers": Case({f"{ARCH}.block_count": Typed(2**31, VT.UINT32)}, ("block_count", "2,147,483,648"), ModelError),
    "a million layers": Case(
        {f"{ARCH}.block_count": Typed(10**6, VT.UINT32)}, ("block_count", "1,000,000"), ModelError, ("info", "run")
    ),
    "2^64-1 layers": Case({f"{ARCH}.block_count": Typed(U64_MAX, VT.UINT64)}, ("block_count",), ModelError),
    "2^31 heads": Case({f"{ARCH}.attention.head_count": Typed(2**31, VT.UINT32)}, ("head_count",), ModelError),
    "2^32-1 kv heads": Case(
        {f"{ARCH}.attention.head_count_kv": Typed(2**32 - 1, VT.UINT32)}, ("key/value heads",), ModelError
    ),
    "2^40 embedding": Case(
        {f"{ARCH}.embedding_length": Typed(2**40, VT.UINT64)}, ("token_embd.weight",), ModelError, ("info", "run")
    ),
    "2^62 feed-forward": Case({f"{ARCH}.feed_forward_length": Typed(2**62, VT.UINT64)}, ("ffn_",), ModelError),
    "2^40 context": Case(
        {f"{ARCH}.context_length": Typed(2**40, VT.UINT64)}, ("context_length", f"{MAX_CONTEXT:,}"), ModelError
    ),
    "vocab_size past the embedding": Case({f"{ARCH}.vocab_size": Typed(2**31, VT.UINT32)}, ("vocab_size",), ModelError),
    "experts in a dense model": Case({f"{ARCH}.expert_count": Typed(2**20, VT.UINT32)}, ("expert_count",), ModelError),
    "NaN rope base": Case({f"{ARCH}.rope.freq_base": Typed(math.nan, VT.FLOAT32)}, ("freq_base", "finite"), ModelError),
    "negative rms eps": Case(
        {f"{ARCH}.attention.layer_norm_rms_epsilon": Typed(-1.0, VT.FLOAT32)}, ("rms_epsilon",), ModelError
    ),
}
TYPES: dict[str, Case] = {
    "tokens as INT32": Case(
        {"tokenizer.ggml.tokens": Typed(list(range(512)), VT.ARRAY, VT.INT32)},
        ("tokenizer.ggml.tokens", "ARRAY of INT32", "expected ARRAY of STRING"),
        GgufError,
        TOKENIZER_COMMANDS,
    ),
    "merges as INT32": Case(
        {"tokenizer.ggml.merges": Typed(list(range(253)), VT.ARRAY, VT.INT32)},
        ("tokenizer.ggml.merges", "ARRAY of INT32"),
        GgufError,
        TOKENIZER_COMMANDS,
    ),
    "token types as STRING": Case(
        {"tokenizer.ggml.token_type": Typed(["1"] * 512, VT.ARRAY, VT.STRING)},
        ("tokenizer.ggml.token_type", "ARRAY of STRING", "integer"),
        GgufError,
        TOKENIZER_COMMANDS,
    ),
    "tokens as one INT32": Case(
        {"tokenizer.ggml.tokens": Typed(512, VT.INT32)}, ("tokenizer.ggml.tokens", "INT32"), GgufError, ("tokenize",)
    ),
    "scores as STRING": Case(
        {"tokenizer.ggml.scores": Typed(["0"] * 512, VT.ARRAY, VT.STRING)}, ("tokenizer.ggml.scores",), GgufError
    ),
    "bos id as STRING": Case(
        {"tokenizer.ggml.bos_token_id": Typed("509", VT.STRING)},
        ("bos_token_id", "STRING", "integer"),
        GgufError,
        ("info", "tokenize"),
    ),
    "add_bos as STRING": Case(
        {"tokenizer.ggml.add_bos_token": Typed("yes", VT.STRING)}, ("add_bos_token", "BOOL"), GgufError, ("run",)
    ),
    "chat template as UINT32": Case(
        {"tokenizer.chat_template": Typed(7, VT.UINT32)}, ("tokenizer.chat_template", "UINT32"), GgufError, ("run",)
    ),
    "chat template as an array": Case(
        {"tokenizer.chat_template": Typed(["{{ x }}"], VT.ARRAY, VT.STRING)}, ("ARRAY of STRING",), GgufError
    ),
    "tokenizer model as INT32": Case(
        {"tokenizer.ggml.model": Typed(2, VT.INT32)}, ("tokenizer.ggml.model",), GgufError, ("tokenize",)
    ),
    "name as UINT32": Case({"general.name": Typed(1, VT.UINT32)}, ("general.name",), GgufError),
    "file type as STRING": Case({"general.file_type": Typed("Q4_K_M", VT.STRING)}, ("general.file_type",), GgufError),
    "block_count as STRING": Case(
        {f"{ARCH}.block_count": Typed("24", VT.STRING)}, ("block_count", "integer", "STRING"), ModelError
    ),
    "block_count as FLOAT32": Case(
        {f"{ARCH}.block_count": Typed(2.0, VT.FLOAT32)}, ("block_count", "integer", "float"), ModelError
    ),
    "rope base as STRING": Case(
        {f"{ARCH}.rope.freq_base": Typed("1e6", VT.STRING)}, ("freq_base", "number", "STRING"), ModelError
    ),
}
_YARN = {f"{ARCH}.rope.scaling.type": Typed("yarn", VT.STRING)}
SCALING: dict[str, Case] = {
    "linear rope scaling": Case(
        {f"{ARCH}.rope.scaling.type": Typed("linear", VT.STRING)}, ("rope.scaling.type", "none or yarn"), ModelError
    ),
    "yarn without a factor": Case(_YARN, ("rope.scaling.factor",), ModelError),
    "yarn that shrinks": Case(
        _YARN | {f"{ARCH}.rope.scaling.factor": Typed(0.5, VT.FLOAT32)}, ("rope.scaling", "no stretch"), ModelError
    ),
    "yarn of NaN factor": Case(
        _YARN | {f"{ARCH}.rope.scaling.factor": Typed(math.nan, VT.FLOAT32)}, ("rope.scaling.factor",), ModelError
    ),
    "yarn betas crossed": Case(
        _YARN
        | {
            f"{ARCH}.rope.scaling.factor": Typed(4.0, VT.FLOAT32),
            f"{ARCH}.rope.scaling.yarn_beta_fast": Typed(1.0, VT.FLOAT32),
            f"{ARCH}.rope.scaling.yarn_beta_slow": Typed(32.0, VT.FLOAT32),
        },
        ("no stretch", "betas"),
        ModelError,
    ),
}
CASES = COUNTS | TYPES | SCALING


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    out = {name: write_with(d / f"case{i}.gguf", case.overrides) for i, (name, case) in enumerate(CASES.items())}
    out["good"] = write_with(d / "good.gguf", {})
    return out


def _argv(command: str, path: Path) -> list[str]:
    return {
        "info": ["info", str(path)],
        "tokenize": ["tokenize", str(path), "hello"],
        "run": ["run", "--raw", "-n", "1", str(path), "hello"],
    }[command]


@pytest.mark.parametrize(
    ("name", "command"), [(name, command) for name, case in CASES.items() for command in case.commands]
)
def test_cli_refuses_in_one_line(files, name, command):
    done, seconds = run_bounded(_argv(command, files[name]))
    line = assert_one_line_error(done, seconds)
    for fragment in CASES[name].says:
        assert fragment.lower() in line.lower(), line


@pytest.mark.parametrize("name", list(CASES))
def test_api_raises_the_named_error(files, name):
    with pytest.raises(CASES[name].error) as info:
        describe(str(files[name]))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["info", "tokenize", "run"])
def test_the_untouched_file_still_works(files, command):
    done, _ = run_bounded(_argv(command, files["good"]))
    assert done.returncode == 0, done.stderr.decode()


def test_architecture_stored_as_a_number_is_named():
    # GGUFWriter always writes general.architecture as a string, so this header is built by hand
    key = b"general.architecture"
    raw = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<II", VT.UINT32, 2)
    with pytest.raises(GgufError, match=r"general\.architecture.*UINT32.*expected STRING"):
        check_layout(raw, len(raw), "x.gguf")


def test_info_says_the_quant_label_is_the_files_own(tmp_path):
    # llama.cpp's Q4_K_M recipe falls back to Q5_0 where rows are too short for K-quant blocks
    path = write_synthetic(tmp_path / "q4km.gguf", "tiny-qwen2", "q4_k_m", seed=1)
    facts = describe(str(path))
    assert facts["quant"] == {"label": "Q4_K_M", "most_bytes": "Q5_0"}
    done, _ = run_bounded(["info", str(path)])
    assert done.returncode == 0, done.stderr.decode()
    text = done.stdout.decode()
    assert "Q4_K_M (the file's own label, general.file_type)" in text and "most bytes are Q5_0" in text
    done, _ = run_bounded(["info", "--json", str(path)])
    assert json.loads(done.stdout)["quant"]["label"] == "Q4_K_M"


def test_a_file_without_a_file_type_has_no_label(tmp_path):
    path = write_with(tmp_path / "unlabelled.gguf", {"general.file_type": None})
    assert describe(str(path))["quant"] == {"label": None, "most_bytes": "F32"}
    done, _ = run_bounded(["info", str(path)])
    assert "quant label   none (no general.file_type); most bytes are F32" in done.stdout.decode()


def _header(tensor_count: int, kv_count: int, body: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + body


def _key(key: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        # enough bytes for every entry the counts claim, but more entries than any real file holds
        (_header(0, MAX_KV_COUNT + 1, (_key(b"k") + struct.pack("<IB", VT.UINT8, 0)) * (MAX_KV_COUNT + 1)), "65,537"),
        (_header(MAX_TENSOR_COUNT + 1, 0, bytes(MIN_TENSOR_INFO_BYTES * (MAX_TENSOR_COUNT + 1))), "65,537 tensors"),
        (
            _header(0, 1, _key(b"a") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, MAX_STRING_ELEMENTS + 1))
            + bytes(8 * (MAX_STRING_ELEMENTS + 1)),
            f"{MAX_STRING_ELEMENTS + 1:,} STRING elements",
        ),
        (
            _header(0, 1, _key(b"a") + struct.pack("<IIQ", VT.ARRAY, VT.UINT8, MAX_ARRAY_ELEMENTS + 1))
            + bytes(MAX_ARRAY_ELEMENTS + 1),
            f"{MAX_ARRAY_ELEMENTS + 1:,} UINT8 elements",
        ),
    ],
    ids=["metadata entries", "tensors", "strings", "numbers"],
)
def test_counts_past_a_sane_bound_are_refused_before_anything_is_built(raw, says):
    started = time.perf_counter()
    with pytest.raises(GgufError, match="fuselane reads at most") as info:
        check_layout(raw, len(raw), "x.gguf")
    assert says in str(info.value)
    assert time.perf_counter() - started < BOUND_SECONDS

"""Hostile or inconsistent mixture files: counts and shapes the tensors do not back.

Each file is a tiny mixture (tests.test_bad_input's writer: float weights, the synthetic tokenizer) with one
claim wrong: an expert count of 0 or past the tensors, more experts kept a token than there are, an expert
tensor of the wrong shape, a missing shared expert, an expert count in a dense architecture. Every case must
end, through `run` (and `info`'s API), in one `fuselane: error:` line naming what is wrong, exit code 1, quickly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from fuselane.errors import ModelError
from fuselane.gguf.synth import SHAPES
from fuselane.info import describe
from tests.bounded import assert_one_line_error, run_bounded
from tests.test_bad_input import _add, tiny_meta, tiny_weights

Q3, Q2 = SHAPES["tiny-qwen3moe"], SHAPES["tiny-qwen2moe"]


def write_with(path: Path, shape, meta: Mapping[str, object], tensors: Mapping[str, np.ndarray | None]) -> Path:
    """The tiny mixture of `shape` with the metadata of `meta` (None: left out) and tensors of `tensors`
    (None: left out) put in place of its own."""
    writer = gguf.GGUFWriter(path, shape.arch)
    for key, value in (tiny_meta(shape) | dict(meta)).items():
        if value is not None:
            _add(writer, key, value)
    for name, data in (tiny_weights(shape) | dict(tensors)).items():
        if data is not None:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Case:
    shape: object
    meta: dict
    tensors: dict
    says: tuple[str, ...]


_WRONG = np.zeros((Q3.experts - 1, Q3.expert_ff, Q3.n_embd), dtype=np.float32)
CASES = {
    "no experts": Case(Q3, {"qwen3moe.expert_count": 0}, {}, ("expert_count", "positive", "not 0")),
    "more kept than there are": Case(
        Q3, {"qwen3moe.expert_used_count": 9}, {}, ("expert_used_count", "9 experts a token", "8")
    ),
    "an expert tensor short of an expert": Case(
        Q3, {}, {"blk.1.ffn_gate_exps.weight": _WRONG}, ("blk.1.ffn_gate_exps.weight", "(7, 32, 64)", "(8, 32, 64)")
    ),
    "a million experts": Case(Q3, {"qwen3moe.expert_count": 10**6}, {}, ("ffn_gate_inp.weight", "1000000")),
    "the expert width past the tensors": Case(
        Q3, {"qwen3moe.expert_feed_forward_length": 2**31}, {}, ("ffn_gate_exps.weight", "2147483648")
    ),
    "no expert width": Case(Q3, {"qwen3moe.expert_feed_forward_length": None}, {}, ("expert_feed_forward_length",)),
    "a down tensor of two dimensions": Case(
        Q3, {}, {"blk.0.ffn_down_exps.weight": np.zeros((8, 64 * 32), np.float32)}, ("blk.0.ffn_down_exps.weight",)
    ),
    "no shared expert": Case(Q2, {}, {"blk.0.ffn_up_shexp.weight": None}, ("blk.0.ffn_up_shexp.weight", "missing")),
    "a shared gate of the wrong width": Case(
        Q2, {}, {"blk.0.ffn_gate_inp_shexp.weight": np.zeros(32, np.float32)}, ("ffn_gate_inp_shexp", "(32,)")
    ),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile_moe")
    out = {
        name: write_with(d / f"case{i}.gguf", c.shape, c.meta, c.tensors) for i, (name, c) in enumerate(CASES.items())
    }
    out["good-qwen3moe"] = write_with(d / "good3.gguf", Q3, {}, {})
    out["good-qwen2moe"] = write_with(d / "good2.gguf", Q2, {}, {})
    return out


# The CLI's path is the API's; three cases through it keep the subprocesses few.
CLI_CASES = ("no experts", "more kept than there are", "an expert tensor short of an expert")


def run_refuses_in_one_line(path: Path, says: Sequence[str], *options: str) -> None:
    """`fuselane run` on a hostile file: one error line that says each of `says` (the other hostile-file suites
    share it)."""
    line = assert_one_line_error(*run_bounded(["run", "--raw", "-n", "1", *options, str(path), "hi"]))
    for fragment in says:
        assert fragment.lower() in line.lower(), line


def describe_raises_a_model_error(path: Path, says: Sequence[str]) -> None:
    """`describe` on a hostile file raises one line of ModelError that says each of `says`."""
    with pytest.raises(ModelError) as info:
        describe(str(path))
    assert "\n" not in str(info.value)
    for fragment in says:
        assert fragment.lower() in str(info.value).lower(), info.value


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_refuses_in_one_line(files, name):
    run_refuses_in_one_line(files[name], CASES[name].says)


@pytest.mark.parametrize("name", list(CASES))
def test_api_raises_a_model_error(files, name):
    describe_raises_a_model_error(files[name], CASES[name].says)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_the_untouched_files_run(files, arch):
    done, _ = run_bounded(["run", "--raw", "-n", "2", "--lane", "cpu", str(files[f"good-{arch}"]), "hi"])
    assert done.returncode == 0, done.stderr.decode()

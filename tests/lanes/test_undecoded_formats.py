"""A matrix in a format no cuda kernel decodes is a reason the lane cannot run the model, said before anything
runs: `explain` shows the plan and names the matrix, `--lane cuda` refuses in one line, `--lane auto` runs the
model on the cpu lane, which decodes every format of the table.

The lane decodes every format of the table today (MXFP4, the last, since its blocks are kept as IQ4_NL's:
`kernels.STORED_BLOCK_BYTES`), so these tests take MXFP4 out of the lane's decoded formats (`kernels.
DEQUANT_FORMATS`), as a format added to the table before its kernels would be; `tests/cuda_kernels/
test_mxfp4_lane.py` runs the same files on the lane."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.cli import main
from fuselane.errors import FuselaneError
from fuselane.explain import build_plan
from fuselane.fuse.views import leaves
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import write_synthetic
from fuselane.graph.ir import Fused
from fuselane.lanes.cuda.plan import kernels
from fuselane.runtime import model as runtime

DENSE_WHY = "blk.0.ffn_down.weight is MXFP4, which no kernel of the lane decodes (the cpu lane runs it)"
EXPERTS_WHY = "blk.0.ffn_gate_exps.weight is MXFP4, which no kernel of the lane decodes (the cpu lane runs it)"


def _mxfp4(path, shape: str, names: list[str]) -> str:
    return str(write_synthetic(path, shape, "q8_0", seed=2, formats=dict.fromkeys(names, Format.MXFP4)))


@pytest.fixture(autouse=True)
def undecoded(monkeypatch):
    """MXFP4 as a format no kernel of the lane decodes."""
    monkeypatch.setattr(kernels, "DEQUANT_FORMATS", kernels.DEQUANT_FORMATS - {Format.MXFP4})


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mxfp4")
    downs = [f"blk.{i}.ffn_down.weight" for i in range(2)]
    experts = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")]
    return {
        "dense": _mxfp4(d / "dense.gguf", "tiny-qwen3", downs),
        "experts": _mxfp4(d / "experts.gguf", "tiny-qwen3moe", experts),
        "plain": str(write_synthetic(d / "plain.gguf", "tiny-qwen3", "q8_0", seed=2)),
    }


@pytest.mark.parametrize(("kind", "why"), [("dense", DENSE_WHY), ("experts", EXPERTS_WHY)])
def test_explain_names_the_matrix(files, kind, why):
    _, _, plan = build_plan(files[kind], lane="cuda")
    assert plan.cannot_run is not None and plan.cannot_run.endswith(why)
    # no fused op takes it (each is declined, not built and then stopped at): it stays a primitive's
    matrix = why.split()[0]
    readers = [op for op in plan.ops if matrix in {x for leaf in leaves(op) for x in leaf.ins}]
    assert readers and all(not isinstance(op.sym, Fused) for op in readers)


def test_a_file_the_lane_decodes_is_not_refused(files):
    assert build_plan(files["plain"], lane="cuda")[2].cannot_run is None


@pytest.mark.parametrize(("kind", "why"), [("dense", DENSE_WHY), ("experts", EXPERTS_WHY)])
def test_the_cuda_lane_refuses_before_torch_is_asked(files, kind, why):
    with pytest.raises(FuselaneError, match="lane cannot run this model: .*MXFP4, which no kernel"):
        runtime.load(files[kind], lane="cuda", ctx=32)


def test_the_command_says_so_in_one_line(files, capsys):
    assert main(["run", files["experts"], "hi", "--lane", "cuda", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and EXPERTS_WHY in err and "Traceback" not in err


def test_auto_runs_it_on_the_cpu_lane(files, monkeypatch):
    monkeypatch.setattr(runtime, "_cuda_available", lambda: True)  # as on a GPU host
    m = runtime.load(files["experts"], lane="auto", ctx=32)
    assert m.lane.name == "cpu"
    assert np.isfinite(np.asarray(m.session().feed([5, 60, 7]))).all()


def test_synth_refuses_formats_of_tensors_it_does_not_write(tmp_path):
    with pytest.raises(FuselaneError, match="formats name tensors the model does not have"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q8_0", formats={"blk.9.ffn_down.weight": Format.Q8_0})

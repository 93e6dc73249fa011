"""A matrix the cuda lane decodes nowhere it is read is a reason the lane cannot run the model, said before anything
runs: `explain` shows the plan and names the matrix, `--lane cuda` refuses in one line, `--lane auto` runs the
model on the cpu lane, which decodes every format of the table.

The grid and ternary formats (`formats.GRID_FORMATS`: IQ2_*, IQ3_*, IQ1_*, TQ*) are decoded by the cpu lane
everywhere and by the cuda lane in a product (`triton/grid/`: a dense projection, a mixture's experts), an
embedding's gather and a latent attention's per-head product (decoded once to f32 values). A mixture whose gate
and up experts differ in format is such a matrix: the gate/up launch cannot take it (it decodes one). The grid
files the lane runs are tested in `tests/cuda_kernels/test_grid_lane.py`, `test_grid_experts_lane.py` and
`tests/cuda_kernels/test_low_bit_prefill.py` (the per-head product)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fuselane.cli import main
from fuselane.errors import FuselaneError
from fuselane.explain import build_plan
from fuselane.fuse.views import leaves
from fuselane.gguf.formats import GRID_FORMATS, Format
from fuselane.gguf.synth import SHAPES, Shape, write_synthetic
from fuselane.graph.ir import Fused
from fuselane.runtime import model as runtime

GATE_UP_WHY = (
    "blk.0.ffn_gate_exps.weight is Q4_K and blk.0.ffn_up_exps.weight is Q6_K: a mixture's gate and up experts "
    "multiply in one launch that decodes one format (the cpu lane runs it)"
)
REFUSED = {"gate_up": GATE_UP_WHY}
# rows of whole 256-value super-blocks, as the grid formats need
DENSE = Shape("qwen3", 256, 2, 4, 2, 64, 512, 512, context=4096)
# DeepSeek-V2-Lite's latent attention at one layer and narrow widths: its value product's rows are the latent's 512
LATENT = replace(SHAPES["deepseek-v2-lite"], n_layers=1, vocab=512, n_embd=256, n_heads=2, n_ff=256)
EXPERTS = Shape("qwen3moe", 256, 2, 4, 2, 64, 512, 512, context=4096, experts=4, experts_used=2, expert_ff=256)


def _write(path, shape: Shape, names: list[str], fmt: Format) -> str:
    return str(write_synthetic(path, shape, "q8_0", seed=2, formats=dict.fromkeys(names, fmt)))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("grid")
    downs = [f"blk.{i}.ffn_down.weight" for i in range(2)]
    experts = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")]
    mixed = {"blk.0.ffn_gate_exps.weight": Format.Q4_K, "blk.0.ffn_up_exps.weight": Format.Q6_K}
    return {
        "dense": _write(d / "dense.gguf", DENSE, downs, Format.IQ2_XXS),
        "experts": _write(d / "experts.gguf", EXPERTS, experts, Format.IQ3_XXS),
        "embedding": _write(d / "embedding.gguf", DENSE, ["token_embd.weight"], Format.IQ3_S),
        "per_head": _write(d / "per_head.gguf", LATENT, ["blk.0.attn_v_b.weight"], Format.IQ2_XXS),
        "gate_up": str(write_synthetic(d / "gate_up.gguf", EXPERTS, "q8_0", seed=2, formats=mixed)),
        "plain": str(write_synthetic(d / "plain.gguf", "tiny-qwen3", "q8_0", seed=2)),
    }


@pytest.mark.parametrize(("kind", "why"), list(REFUSED.items()))
def test_explain_names_the_matrix(files, kind, why):
    _, _, plan = build_plan(files[kind], lane="cuda")
    assert plan.cannot_run is not None and plan.cannot_run.endswith(why)
    # no fused op takes it (each is declined, not built and then stopped at): it stays a primitive's
    matrix = why.split()[0]
    readers = [op for op in plan.ops if matrix in {x for leaf in leaves(op) for x in leaf.ins}]
    assert readers and all(not isinstance(op.sym, Fused) for op in readers)


@pytest.mark.parametrize("kind", ["plain", "dense", "experts", "embedding", "per_head"])
def test_a_file_the_lane_decodes_is_not_refused(files, kind):
    assert build_plan(files[kind], lane="cuda")[2].cannot_run is None


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_cuda_lane_refuses_before_torch_is_asked(files, kind):
    with pytest.raises(FuselaneError, match="lane cannot run this model: " + REFUSED[kind].split()[0]):
        runtime.load(files[kind], lane="cuda", ctx=32)


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_command_says_so_in_one_line(files, kind, capsys):
    assert main(["run", files[kind], "hi", "--lane", "cuda", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and REFUSED[kind] in err and "Traceback" not in err


@pytest.mark.parametrize("kind", list(REFUSED))
def test_auto_runs_it_on_the_cpu_lane(files, kind, monkeypatch):
    monkeypatch.setattr(runtime, "_cuda_available", lambda: True)  # as on a GPU host
    m = runtime.load(files[kind], lane="auto", ctx=32)
    assert m.lane.name == "cpu"
    assert np.isfinite(np.asarray(m.session().feed([5, 60, 7]))).all()


def test_synth_refuses_formats_of_tensors_it_does_not_write(tmp_path):
    with pytest.raises(FuselaneError, match="formats name tensors the model does not have"):
        write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q8_0", formats={"blk.9.ffn_down.weight": Format.Q8_0})


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS), ids=lambda f: f.name)
def test_the_cpu_lane_runs_every_grid_format(tmp_path, fmt):
    # every projection of both layers in the format: the prompt's logits are finite and differ from a Q8_0
    # file's of the same seed (the matrices were read in the format, not skipped)
    names = [f"blk.{i}.{m}.weight" for i in range(2) for m in ("attn_q", "attn_output", "ffn_gate", "ffn_up")]
    path = _write(tmp_path / "m.gguf", DENSE, names, fmt)
    logits = np.asarray(runtime.load(path, lane="cpu", ctx=32).session().feed([5, 60, 7]))
    plain = np.asarray(
        runtime.load(_write(tmp_path / "p.gguf", DENSE, [], Format.Q8_0), lane="cpu", ctx=32).session().feed([5, 60, 7])
    )
    assert np.isfinite(logits).all() and not np.allclose(logits, plain)
    assert build_plan(path, lane="cuda")[2].cannot_run is None

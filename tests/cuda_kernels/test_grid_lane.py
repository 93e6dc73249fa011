"""The grid and ternary formats on the cuda lane: a step's and a short chunk's products on the grid GEMV
(`triton/grid/gemv.py`), a prompt's chunk on cuBLAS over the f16 scratch or copies the grid decode writes
(`triton/grid/decode.py`), against the cpu lane in f64 within the lane's contract; the GEMV alone against f64
with each epilogue. Interpreted where there is no GPU, compiled on one.

A grid matrix multiplies alone: the fused ops that would hold it are taken apart (`fits`), so the plan's
launches a layer grow, and `explain` says why."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.explain import build_plan  # noqa: E402
from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, QK_K, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ir import Fused  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.triton.grid.values import GRID_GROUP  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402
from tests.lane_steps import rel, runs_as_the_cpu_lane  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows of whole 256-value super-blocks; 4 query heads a kv head; one layer keeps the interpreter's time short
QWEN2 = Shape("qwen2", 256, 1, 4, 1, 64, 512, 512, context=64)
QWEN3 = Shape("qwen3", 256, 1, 4, 1, 64, 512, 512, context=64)
PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: a chunk on cuBLAS
SHORT = [12, 13, 14]  # within the GEMV's rows: the grid GEMV over three rows
assert len(PROMPT) > kernels.GEMV_ROWS >= len(SHORT)
# every projection of the layer in a grid format, seven of them in one file (Qwen2's q, k and v with biases)
SEVEN = {
    "attn_q": Format.IQ2_XXS,
    "attn_k": Format.IQ2_XS,
    "attn_v": Format.IQ3_XXS,
    "attn_output": Format.IQ2_S,
    "ffn_gate": Format.IQ3_S,
    "ffn_up": Format.IQ1_S,
    "ffn_down": Format.IQ1_M,
}
TERNARY = {"attn_q": Format.TQ2_0, "attn_output": Format.TQ1_0, "ffn_down": Format.TQ2_0, "ffn_up": Format.TQ1_0}
# a file mixing a grid format with the mix's Q8_0 (the value product, the output projection): the grid
# projections' norms write their int8 form for them (NormQuant)
MIXED = {m: Format.IQ2_XXS for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
assert set(SEVEN.values()) | set(TERNARY.values()) == GRID_FORMATS


def _write(path, shape: Shape, formats: dict[str, Format]) -> str:
    names = {f"blk.0.{m}.weight": f for m, f in formats.items()}
    return str(write_synthetic(path, shape, "q8_0", seed=5, formats=names))


@pytest.mark.parametrize(
    ("shape", "formats", "activations"),
    [(QWEN2, SEVEN, "int8"), (QWEN2, SEVEN, "dequant"), (QWEN3, TERNARY, "int8"), (QWEN3, MIXED, "int8")],
    ids=["qwen2-grid-int8", "qwen2-grid-dequant", "qwen3-ternary-int8", "qwen3-mixed-int8"],
)
def test_a_grid_model_runs_as_the_cpu_lane(tmp_path, shape, formats, activations):
    path = _write(tmp_path / "m.gguf", shape, formats)
    if formats is MIXED:
        assert C.NORM_QUANT in {class_of(op) for op in build_plan(path, lane="cuda")[2].ops}
    runs_as_the_cpu_lane(path, PROMPT, SHORT, [9, 77], ctx=32, knobs=[f"activations={activations}"])


@pytest.mark.parametrize("prefill", ["f16-copy", "in-place", "int8"])
def test_a_prompt_under_every_prefill_runs_as_the_cpu_lane(tmp_path, prefill):
    # no in-kernel or int8 GEMM decodes a grid matrix: a chunk's grid products take f16 copies under those knobs
    path = _write(tmp_path / "m.gguf", QWEN3, {"attn_q": Format.IQ2_XXS, "ffn_down": Format.IQ3_S})
    runs_as_the_cpu_lane(path, PROMPT, SHORT, [], ctx=32, knobs=[f"prefill={prefill}"])


def test_the_fused_ops_that_would_hold_a_grid_matrix_are_taken_apart(tmp_path):
    # the gate's product: the GEMV's gated pair takes a grid matrix only with its up product in the same grid
    # format (here Q8_0), so it runs alone
    path = _write(tmp_path / "m.gguf", QWEN3, {"ffn_gate": Format.IQ2_XXS})
    _, _, plan = build_plan(path, lane="cuda")
    assert plan.cannot_run is None
    matrix = "blk.0.ffn_gate.weight"
    readers = [op for op in plan.ops if matrix in {x for leaf in leaves(op) for x in leaf.ins}]
    assert readers and all(not isinstance(op.sym, Fused) for op in readers)
    assert any(matrix in why and "a grid format" in why for why in map(str, plan.missed))
    # and the same file with the projection in Q8_0 fuses it
    plain = str(write_synthetic(tmp_path / "p.gguf", QWEN3, "q8_0", seed=5))
    fused = [op for op in build_plan(plain, lane="cuda")[2].ops if matrix in {x for lf in leaves(op) for x in lf.ins}]
    assert any(isinstance(op.sym, Fused) for op in fused)


def test_a_grid_product_keeps_its_epilogues(tmp_path):
    # the grid GEMV's epilogue adds a bias, lands a row in the cache, or adds the residual and norms the row:
    # those fused ops hold the grid matrix
    formats = {"attn_q": Format.IQ2_XXS, "attn_v": Format.IQ3_S, "ffn_down": Format.IQ1_M}
    path = _write(tmp_path / "m.gguf", QWEN2, formats)
    ops = build_plan(path, lane="cuda")[2].ops
    holding = {m: [op.sym.cls for op in ops if f"blk.0.{m}.weight" in {x for lf in leaves(op) for x in lf.ins}]
               for m in formats}  # fmt: skip
    # (the down projection's norm writes its int8 form too, for the mix's Q8_0 output projection)
    assert holding == {"attn_q": [C.GEMM_BIAS], "attn_v": [C.ROW_WRITE], "ffn_down": [C.NORM_QUANT]}


@pytest.mark.parametrize("tied", [False, True], ids=["own-output", "tied"])
def test_an_embedding_in_a_grid_format_is_gathered_from_its_table(tmp_path, tied):
    # llama.cpp's IQ2_S, IQ2_M and IQ3_XXS mixes write the table IQ3_S: the gather and norm decode its rows (one
    # launch); a tied table is the output head's matrix too, on the grid GEMV (a step) and its decode (a chunk)
    shape = Shape("qwen3", 256, 1, 4, 1, 64, 512, 512, context=64, tied=tied)
    path = str(write_synthetic(tmp_path / "e.gguf", shape, "q8_0", seed=5, formats={"token_embd.weight": Format.IQ3_S}))
    ops = build_plan(path, lane="cuda")[2].ops
    readers = [class_of(op) for op in ops if "token_embd.weight" in {x for lf in leaves(op) for x in lf.ins}]
    assert readers[0] is C.EMBED_NORM and len(readers) == 1 + tied
    runs_as_the_cpu_lane(path, PROMPT, SHORT, [9, 77], ctx=32)
    # only a tied table is a product's matrix, so only then does `pdl=auto` launch in plain stream order
    lane = load(path, lane="cuda", ctx=32).lane
    assert (Format.IQ3_S in lane.dense_formats()) is tied
    assert lane.shim.dependent_launches(lane.dense_formats()) is not tied


@pytest.mark.parametrize(
    ("shape", "formats", "parts", "knobs", "turned"),
    [
        # with their biases; the value Q8_0, apart; the query's and key's rotations in the GEMV's epilogue
        (QWEN2, {"attn_q": Format.IQ2_S, "attn_k": Format.IQ2_S}, 2, [], True),
        # v in its cache row: three parts, whose q/k norm and rope keep a launch of their own under `auto` ...
        (QWEN3, {"attn_q": Format.IQ3_S, "attn_k": Format.IQ3_S, "attn_v": Format.IQ3_S}, 3, [], False),
        # ... and turn in the epilogue under `on`
        (QWEN3, {"attn_q": Format.IQ3_S, "attn_k": Format.IQ3_S, "attn_v": Format.IQ3_S}, 3, ["rope_epilogue=on"],
         True),
    ],
    ids=["qwen2-q-k", "qwen3-q-k-v", "qwen3-q-k-v-turned"],
)  # fmt: skip
def test_a_steps_grid_products_of_one_activation_share_a_launch(tmp_path, shape, formats, parts, knobs, turned):
    # the grid GEMV in parts (llama.cpp's IQ3_M, IQ3_XXS and IQ2_M recipes give q and k one grid format), the
    # query's and key's heads turned in its epilogue where the `rope_epilogue` rule turns them
    path = _write(tmp_path / "m.gguf", shape, formats)
    ops = build_plan(path, lane="cuda", knobs=knobs)[2].ops
    merged = [op for op in ops if class_of(op) is C.MERGED_QKV]
    assert len(merged) == 1 and len(merged[0].sym.parts) == parts
    members = [class_of(m) for m in merged[0].sym.parts]
    assert members.count(C.QKV_HEAD_EPILOGUE) == (2 if turned else 0)
    assert (C.ROPE_QK_ONE_LAUNCH in {class_of(op) for op in ops}) != turned
    runs_as_the_cpu_lane(path, PROMPT, SHORT, [9, 77], ctx=32, knobs=knobs)


def test_a_gated_pair_in_one_grid_format_is_one_launch(tmp_path):
    # the gate and the up product in one grid format: the grid GEMV's pair; in two, each alone and the GLU apart
    one = _write(tmp_path / "one.gguf", QWEN3, {"ffn_gate": Format.IQ2_XS, "ffn_up": Format.IQ2_XS})
    two = _write(tmp_path / "two.gguf", QWEN3, {"ffn_gate": Format.IQ2_XS, "ffn_up": Format.IQ3_S})
    # (under int8 the pair writes its int8 form for the down product too: GluActMulQuant around it)
    pairs = {
        name: [op for op in build_plan(p, lane="cuda")[2].ops if C.GEMV_GATE_UP_GLU in _classes(op)]
        for name, p in (("one", one), ("two", two))
    }
    assert [class_of(op) for op in pairs["one"]] == [C.GLU_ACT_MUL_QUANT] and not pairs["two"]
    runs_as_the_cpu_lane(one, PROMPT, SHORT, [9], ctx=32)


def _classes(op) -> set:
    """The fused classes of an op and of the fused ops inside it."""
    inner = op.sym.parts if isinstance(op.sym, Fused) else []
    return {class_of(op)} | {c for part in inner for c in _classes(part)}


def _rows(fmt: Format, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    lay = LAYOUTS[fmt]
    blocks = random_blocks(fmt, n * k // lay.values, np.random.default_rng(seed))
    want = dequantize(blocks.reshape(-1), fmt, (n, k)).astype(np.float64)
    return torch.from_numpy(blocks.reshape(-1)).to(DEVICE), want


def test_the_tile_rule_takes_small_programs_for_a_steps_one_row():
    # by the product's rows, and for few of them by x's rows: a step's one row in 2-row programs of two
    # super-blocks a step (a row's k over 64 threads), a batch's rows in 16-row ones, which read each activation
    # row once for more rows
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv

    assert grid_gemv.grid_tile(18944) is grid_gemv.grid_tile(18944, 4) is grid_gemv.MANY_ROWS_TILE
    assert grid_gemv.grid_tile(3584) is grid_gemv.ONE_ROW_FEW_ROWS_TILE
    assert grid_gemv.grid_tile(3584, 2) is grid_gemv.FEW_ROWS_TILE
    one_row = grid_gemv.ONE_ROW_FEW_ROWS_TILE
    assert one_row.slice > QK_K and one_row.values_a_thread() == GRID_GROUP


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS), ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("tile", ["many_rows", "few_rows", "one_row_few_rows"])
def test_the_grid_gemv_matches_f64(fmt, m, tile, monkeypatch):
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    # each of the tile rule's two tiles (`grid_tile`: by the product's rows) at a tiny product's
    chosen = getattr(grid_gemv, f"{tile.upper()}_TILE")
    monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1: chosen)
    n, k = 20, 512  # a partial tile of rows; two super-blocks a row
    w, want_w = _rows(fmt, n, k, seed=int(fmt) + m)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = torch.empty((m, n), dtype=torch.float32, device=DEVICE)
    gemv_grid(torch.from_numpy(x).to(DEVICE), w, fmt, n, k, out)
    want = x.astype(np.float64) @ want_w.T
    # f32 sums of k products: within k ulps of the largest partial sum, far under this bound
    assert rel(out.cpu().numpy(), want) < 1e-5


# steps of several whole super-blocks (`grid/steps.py`): rows of 3 super-blocks end inside a step of 2 or 4 (the
# last step's groups past the row read its last block and count nothing), rows of 4 end on a step
WIDE_TILES = {"two-blocks": (2, 4, 512), "four-blocks": (1, 4, 1024)}


@pytest.mark.parametrize("fmt", [Format.IQ3_S, Format.IQ2_XXS, Format.IQ1_M, Format.TQ1_0], ids=lambda f: f.name)
@pytest.mark.parametrize("k", [768, 1024])
@pytest.mark.parametrize("tile", WIDE_TILES)
def test_a_step_of_several_super_blocks_matches_f64(fmt, k, tile, monkeypatch):
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv

    chosen = grid_gemv.GridTile(*WIDE_TILES[tile])
    monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1: chosen)
    n, m = 6, 2
    w, want_w = _rows(fmt, n, k, seed=int(fmt) + k)
    x = np.random.default_rng(k).standard_normal((m, k)).astype(np.float32)
    out = torch.empty((m, n), dtype=torch.float32, device=DEVICE)
    grid_gemv.gemv_grid(torch.from_numpy(x).to(DEVICE), w, fmt, n, k, out)
    assert rel(out.cpu().numpy(), x.astype(np.float64) @ want_w.T) < 1e-5


@pytest.mark.parametrize("fmt", [Format.IQ2_XS, Format.TQ2_0], ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3])
def test_a_gated_pair_walks_both_matrices_in_one_loop(fmt, m, monkeypatch):
    # a row of x: the gate's and the up product's groups in one k loop (each activation value loaded once for
    # both); a batch's rows: one product after the other. At a whole-step tile and at a wide one ending inside a
    # step: SiLU(gate) * up against f64 over f32 rows
    from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv

    n, k = 12, 768
    (wg, want_g), (wu, want_u) = _rows(fmt, n, k, seed=1), _rows(fmt, n, k, seed=2)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    g, u = x.astype(np.float64) @ want_g.T, x.astype(np.float64) @ want_u.T
    for tile in (grid_gemv.FEW_ROWS_TILE, grid_gemv.GridTile(*WIDE_TILES["two-blocks"])):
        monkeypatch.setattr(grid_gemv, "grid_tile", lambda n, m=1, tile=tile: tile)
        out = torch.empty((m, n), dtype=torch.float32, device=DEVICE)
        grid_gemv.gemv_grid_gate_up_glu(torch.from_numpy(x).to(DEVICE), wg, wu, fmt, n, k, out)
        assert rel(out.cpu().numpy(), g / (1 + np.exp(-g)) * u) < 1e-5


@pytest.mark.parametrize("fmt", [Format.IQ2_S, Format.TQ1_0], ids=lambda f: f.name)
def test_the_grid_gemv_in_parts_matches_each_alone(fmt):
    # a query with its bias, a key landing at a row of its cache read on the device, and a third part: each part's
    # tiles (the last ones partial) into its own output, as the lone GEMV gives them, bit for bit
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid, gemv_grid_parts

    k, sizes = 512, (40, 24, 8)
    rng = np.random.default_rng(int(fmt))
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)).to(DEVICE)
    ws = [_rows(fmt, n, k, seed=int(fmt) + i) for i, n in enumerate(sizes)]
    bias = torch.from_numpy(rng.standard_normal(sizes[0]).astype(np.float32)).to(DEVICE)
    q, v = torch.empty((1, sizes[0]), device=DEVICE), torch.empty((1, sizes[2]), device=DEVICE)
    cache = torch.zeros((5, sizes[1]), device=DEVICE)
    pos = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    parts = [(ws[0][0], sizes[0], q, bias, None), (ws[1][0], sizes[1], cache, None, (pos, sizes[1])),
             (ws[2][0], sizes[2], v, None, None)]  # fmt: skip
    gemv_grid_parts(x, parts, fmt, k)
    alone = [torch.empty((1, n), device=DEVICE) for n in sizes]
    gemv_grid(x, ws[0][0], fmt, sizes[0], k, alone[0], bias=bias)
    for i in (1, 2):
        gemv_grid(x, ws[i][0], fmt, sizes[i], k, alone[i])
    assert torch.equal(q, alone[0]) and torch.equal(v, alone[2]) and torch.equal(cache[2:3], alone[1])
    assert not cache[:2].any() and not cache[3:].any()
    assert rel(q.cpu().numpy(), x.cpu().numpy().astype(np.float64) @ ws[0][1].T + bias.cpu().numpy()) < 1e-5


def test_the_grid_gemv_epilogues(tmp_path):
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    fmt, n, k, m = Format.IQ2_XS, 24, 256, 2
    w, want_w = _rows(fmt, n, k, seed=3)
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(DEVICE)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DEVICE)
    product = x.cpu().numpy().astype(np.float64) @ want_w.T
    # a bias and a residual added in place
    res = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(DEVICE)
    want = product + bias.cpu().numpy() + res.cpu().numpy()
    gemv_grid(x, w, fmt, n, k, res, bias=bias, residual=res)
    assert rel(res.cpu().numpy(), want) < 1e-5
    # rows landing at a position read on the device, in a wider table
    table = torch.zeros((6, n + 8), dtype=torch.float32, device=DEVICE)
    pos = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    gemv_grid(x, w, fmt, n, k, table, out_row=(pos, table.stride(0)))
    got = table.cpu().numpy()
    assert rel(got[3:5, :n], product) < 1e-5
    assert not got[:3].any() and not got[5:].any() and not got[:, n:].any()


@pytest.mark.parametrize("chunk", [None, 16], ids=["held", "chunked"])
def test_the_grid_add_norm_matches_f64(chunk):
    # sum_out = x @ W^T + residual in place, then its RMS norm by the last program: against f64, and the counter
    # left at zero for the next launch
    from fuselane.lanes.cuda.triton.gemv.epilogue import gemv_add_norm_counter
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_add_norm

    fmt, n, k, eps = Format.IQ3_XXS, 40, 256, 1e-6
    w, want_w = _rows(fmt, n, k, seed=6)
    rng = np.random.default_rng(7)
    x, res, norm_w = (rng.standard_normal(s).astype(np.float32) for s in ((1, k), n, n))
    s = x.astype(np.float64) @ want_w.T + res
    want = s / np.sqrt(np.mean(s * s) + eps) * norm_w
    res_t = torch.from_numpy(res).to(DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    x_t, norm_t = (torch.from_numpy(a).to(DEVICE) for a in (x, norm_w))
    gemv_grid_add_norm(x_t, w, fmt, n, k, res_t, res_t, norm_t, eps, out, counter, norm_chunk=chunk)
    assert rel(res_t.cpu().numpy(), s[0]) < 1e-5 and rel(out.cpu().numpy(), want[0]) < 1e-5
    assert int(counter.item()) == 0


def test_the_grid_add_norm_writes_the_normed_rows_int8_form():
    # the last program's int8 form of the normed row: the lane's own quantize of that row, bit for bit
    from fuselane.lanes.cuda.triton.gemv.epilogue import gemv_add_norm_counter
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid_add_norm
    from fuselane.lanes.cuda.triton.quant import empty_q8, quantize

    fmt, n, k = Format.IQ2_S, 96, 256
    w, _ = _rows(fmt, n, k, seed=8)
    rng = np.random.default_rng(9)
    x, res, norm_w = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(DEVICE) for s in ((1, k), n, n))
    out, q8 = torch.empty(n, dtype=torch.float32, device=DEVICE), empty_q8(1, n, DEVICE)
    gemv_grid_add_norm(x, w, fmt, n, k, res, res.clone(), norm_w, 1e-6, out, gemv_add_norm_counter(DEVICE), out_q8=q8)
    want = quantize(out.view(1, n), empty_q8(1, n, DEVICE))
    for got, ref in zip(q8, want, strict=True):
        assert torch.equal(got.cpu(), ref.cpu())


def test_the_grid_gemv_refuses_what_it_does_not_take():
    from fuselane.lanes.cuda.triton.grid.gemv import gemv_grid

    w, _ = _rows(Format.IQ2_XXS, 4, 256, seed=1)
    x = torch.zeros((1, 256), dtype=torch.float32, device=DEVICE)
    out = torch.empty((1, 4), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="no grid GEMV for Q8_0"):
        gemv_grid(x, w, Format.Q8_0, 4, 256, out)
    with pytest.raises(ValueError, match="IQ2_XXS weights of 4 rows of 256 must be"):
        gemv_grid(x, w[:-1], Format.IQ2_XXS, 4, 256, out)


@pytest.mark.parametrize(
    "formats",
    [
        {"attn_q": Format.IQ3_XXS, "ffn_up": Format.IQ2_S, "ffn_down": Format.TQ2_0},
        # q and k in one grid format: a step of one sequence turns their heads in the GEMV in parts' epilogue
        {"attn_q": Format.IQ3_S, "attn_k": Format.IQ3_S},
    ],
    ids=["alone", "q-k-turned"],
)
def test_a_batch_of_grid_sequences_decodes_as_each_alone(tmp_path, formats):
    # the paged form: two sequences a step, the grid GEMV over the batch's rows; greedy tokens as the cpu lane's
    from fuselane.engine.batch import engine_for
    from fuselane.engine.sequence import Request
    from fuselane.runtime.sampling import GREEDY

    path = _write(tmp_path / "m.gguf", QWEN3, formats)
    gpu = load(path, lane="cuda", ctx=32)
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    engine = engine_for(gpu, blocks=6, max_seqs=2, max_queue=2, block_size=4, chunk=6)
    prompts, events = [[3, 4, 5, 6], [7, 8, 9]], {}
    ids = [
        engine.submit(Request(tuple(p), 3, GREEDY), lambda e: events.setdefault(e.seq, []).append(e)) for p in prompts
    ]
    engine.run_until_idle()
    for seq, prompt in zip(ids, prompts, strict=True):
        assert not any(e.error for e in events[seq])
        got = [t for e in events[seq] for t in e.tokens]
        assert got == list(ref.generate_ids(ref.session(), prompt, max_tokens=3, sampling=GREEDY))

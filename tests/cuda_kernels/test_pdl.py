"""Programmatic dependent launch (`triton/pdl.py`): the contract each kernel keeps, read from its source, and
the launch options a context gives.

A kernel launched as a dependent may start while the kernel before it still runs, so it must wait before it
reads anything that kernel could write. Every kernel here therefore starts with `pdl.begin(PDL)` (release the
next grid, then wait), with `pdl.wait(PDL)`, or with `pdl.release(PDL)` where it hands `PDL` to the GEMV loop
(or its own later wait), whose `pdl.wait` comes after the first chunk's weight loads and before any read of the
activation; a kernel may choose between two such starts by a constexpr. Every launch passes
`pdl.options()`, so no kernel runs as a dependent without its wait compiled in. On the GPU the lane's logits
with and without dependent launches are compared bit for bit (`tests/cuda/test_cuda_lane.py`).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import pdl, quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import gemv_q8  # noqa: E402

TRITON_DIR = Path(pdl.__file__).parent
LOOPS = {"gemv/fast.py", "gemv/q8.py"}  # the GEMV loops that wait after their first weight loads


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(TRITON_DIR).as_posix(), ast.parse(p.read_text())) for p in sorted(TRITON_DIR.rglob("*.py"))]


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "jit" for d in fn.decorator_list)


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    return [
        (name, node)
        for name, tree in _modules()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and _is_jit(node)
    ]


def _pdl_call(stmt: ast.stmt) -> str | None:
    """'begin', 'release' or 'wait' where `stmt` is `pdl.<that>(PDL)`."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "pdl":
            return f.attr
    return None


def _starts(stmt: ast.stmt) -> set[str | None]:
    """How a kernel's first statement starts it: its `pdl` call, or each branch's where it chooses between two
    starts by a constexpr (the mixture's down: reading ahead of its wait, or not)."""
    if isinstance(stmt, ast.If) and stmt.orelse:
        return _starts(stmt.body[0]) | _starts(stmt.orelse[0])
    return {_pdl_call(stmt)}


def test_every_kernel_waits_before_it_reads() -> None:
    kernels = _kernels()
    assert len(kernels) >= 20  # every module was read
    for module, fn in kernels:
        assert fn.args.args[-1].arg == "PDL", f"{module}:{fn.name} takes no PDL"
        starts = _starts(fn.body[0])
        # a wait first (the mixture's gate/up, which releases the next grid only after it) reads nothing early
        assert starts <= {"begin", "release", "wait"}, f"{module}:{fn.name} does not start with pdl.begin/release"
        if "release" in starts:  # the wait is the GEMV loop's (or the kernel's own, later): PDL must reach it
            passed = [a for n in ast.walk(fn) if isinstance(n, ast.Call) for a in n.args]
            assert any(isinstance(a, ast.Name) and a.id == "PDL" for a in passed), f"{module}:{fn.name}"


def test_the_gemv_loops_wait_after_their_first_weights_and_before_the_loop() -> None:
    for module, tree in _modules():
        if module not in LOOPS:
            continue
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "row_dots")
        kinds = [_pdl_call(s) for s in fn.body]
        at = kinds.index("wait")
        loop = next(i for i, s in enumerate(fn.body) if isinstance(s, ast.For))
        assert at < loop, module
        called = {
            n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for s in fn.body[:at]
            for n in ast.walk(s)
            if isinstance(n, ast.Call)
        }
        weights_only = {"load_chunk", "raw_chunk", "zeros", "debug_barrier"}  # a barrier holds loads, reads none
        assert called <= weights_only, f"{module}: {called - weights_only} before the wait"


def test_the_decode_down_loop_reads_only_weights_and_the_routing_before_its_wait() -> None:
    """`moe/down_rows.kept_dots` (MoeDown.READ_AHEAD): before its wait the first chunks' weights and the
    route weights (the routing's, which `down._kept_q8` reads early with the ids), nothing else; the wait
    comes before the loop, and the residual's read after it."""
    tree = dict(_modules())["moe/down_rows.py"]
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "kept_dots")
    at = [_pdl_call(s) for s in fn.body].index("wait")
    loop = next(i for i, s in enumerate(fn.body) if isinstance(s, ast.For))
    assert at < loop
    loads = [n for s in fn.body[:at] for n in ast.walk(s) if isinstance(n, ast.Call) and _name(n) == "load"]
    assert [ast.unparse(n.args[0]) for n in loads] == ["route_w"]
    called = {_name(n) for s in fn.body[:at] for n in ast.walk(s) if isinstance(n, ast.Call)}
    assert called <= {"raw_chunk", "zeros", "debug_barrier", "load"}, called


def _name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def test_the_decode_attention_reads_only_the_steps_inputs_before_its_wait() -> None:
    """The one kernel that reads before its wait: the position, and the first tile's rows before it."""
    tree = dict(_modules())["attention/decode.py"]
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_decode_kernel")
    wait = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == "pdl.wait")
    early = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and n.lineno < wait.lineno]
    names = {ast.unparse(n.func) for n in early}
    assert names <= {"pdl.release", "tl.program_id", "tl.load", "tl.cdiv", "tl.maximum", "tl.minimum", "_tile_kv"}
    assert [ast.unparse(n.args[0]) for n in early if ast.unparse(n.func) == "tl.load"] == ["pos_ptr"]
    (tile,) = (n for n in early if ast.unparse(n.func) == "_tile_kv")
    below = ast.unparse(tile.args[3])
    bound = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == below)
    assert ast.unparse(bound.value) == "tl.minimum(hi, span - 1)"  # rows before the position: earlier steps'


def test_every_launch_passes_the_options() -> None:
    names = {fn.name for _, fn in _kernels()}
    launches = 0
    for module, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            target = node.func.value
            if isinstance(target, ast.Name) and target.id in names:
                launches += 1
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                assert "pdl.options()" in spread, f"{module}: {target.id} launched without pdl.options()"
    assert launches >= len(names)


def test_options_follow_the_context() -> None:
    assert pdl.options() == {"PDL": False}
    with pdl.dependent_launches(True):
        assert pdl.options() == {"PDL": True, "launch_pdl": True}
        with pdl.dependent_launches(False):
            assert pdl.options() == {"PDL": False}
        assert pdl.options()["PDL"]
    assert pdl.options() == {"PDL": False}


def test_a_dependent_launch_gives_the_same_bits() -> None:
    rng = np.random.default_rng(5)
    n, k = 24, 512
    raw = torch.from_numpy(raw_weights(Format.Q4_K, n, k, rng)).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)).to(DEVICE)
    acts = quant.empty_q8(1, k, x.device)
    quant.quantize(x, acts)
    plain = gemv_q8(acts, raw, Format.Q4_K, n, k, torch.empty(1, n, device=DEVICE))
    with pdl.dependent_launches(True):
        quant.quantize(x, acts)
        dependent = gemv_q8(acts, raw, Format.Q4_K, n, k, torch.empty(1, n, device=DEVICE))
    assert torch.equal(plain, dependent)

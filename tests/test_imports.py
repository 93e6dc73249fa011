"""The package's imports: no module imports itself back through others or another's private names, and the plan
side loads neither torch nor Triton, so `fuselane explain --lane cuda` runs on a machine with neither.

The graph is read with `ast` from every module under src/fuselane: every import counts, at module level, inside
a function, or under `TYPE_CHECKING`, since each is an edge a reader has to follow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "fuselane"

# Modules that build and explain a cuda plan: what `explain --lane cuda` imports, and the lane's plan side.
PLAN_SIDE = (
    "fuselane.explain",
    "fuselane.lanes.cuda.plan.shim",
    "fuselane.lanes.cuda.plan.fits",
    "fuselane.lanes.cuda.plan.knobs",
    "fuselane.lanes.cuda.plan.kernels",
    "fuselane.lanes.cuda.plan.rules",
    "fuselane.lanes.cuda.explain_workspace",
)
HEAVY = ("torch", "triton")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative ones resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules `path` imports (a `from pkg import mod` names the submodule where it is one)."""
    module, is_package = module_name(path), path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            subs = {f"{target}.{alias.name}" for alias in node.names}
            found |= (subs & known) or {target}
    return {name for name in found if name in known and name != module}


def import_graph() -> nx.DiGraph:
    paths = sorted((SRC / PACKAGE).rglob("*.py"))
    known = {module_name(p) for p in paths}
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for path in paths:
        g.add_edges_from((module_name(path), target) for target in imports_of(path, known))
    return g


def test_the_graph_is_read() -> None:
    g = import_graph()
    assert g.has_edge("fuselane.fuse.optimizer", "fuselane.fuse.rewriter")
    assert g.has_edge("fuselane.lanes.cuda.plan.shim", "fuselane.lanes.cuda.plan.fits")


def test_no_import_circles() -> None:
    g = import_graph()
    circles = sorted(sorted(c) for c in nx.simple_cycles(g))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_plan_side_imports_neither_torch_nor_triton() -> None:
    # run in a fresh interpreter: what the plan side loads, transitively, without anything this process holds
    code = (
        "import sys\n"
        f"for name in {PLAN_SIDE!r}: __import__(name)\n"
        "from fuselane.explain import build_plan\n"
        "build_plan('synth:tiny-qwen3:q4_k_m', lane='cuda')\n"
        "from fuselane.explain import prefill_workspace\n"
        "prefill_workspace('synth:tiny-qwen3:q4_k_m')\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "", f"the plan side loaded {done.stdout.strip()}"


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")  # `__version__` and its kind are public


def private_imports(path: Path) -> list[str]:
    """`from module import _name` in `path`: a module reaching into another's private names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not _dunder(a.name)]
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = {module_name(p): private_imports(p) for p in sorted((SRC / PACKAGE).rglob("*.py"))}
    found = {module: names for module, names in found.items() if names}
    assert not found, "private names imported across modules:\n" + "\n".join(f"{m}: {n}" for m, n in found.items())


def test_a_private_import_is_caught(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from fuselane.fuse.rewriter import _hidden, Rewriter, __doc__\n")
    assert private_imports(tmp_path / "m.py") == ["fuselane.fuse.rewriter._hidden"]

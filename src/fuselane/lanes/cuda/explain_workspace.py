"""What `fuselane explain --lane cuda --form prefill` says of a chunk's workspace: the rows a session runs a prompt
in, the f16 scratch, cuBLAS's workspace and the share they are held to (`run/workspace`), worked out from the
file's tensors and the chunk's plans as the lane does when it loads, without a GPU (neither torch nor Triton)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fuselane.fuse.optimizer import Plan, optimize
from fuselane.gguf.formats import Format, tensor_bytes
from fuselane.graph.ir import Form
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.lanes.cuda.run import stored, workspace
from fuselane.lanes.cuda.run.buffers import F32_BYTES, parts
from fuselane.models import ModelConfig, recognizer

MB = 1e6


def prefill_workspace(
    cfg: ModelConfig, tensors: Mapping[str, Any], shim: CudaShim, held: Sequence[str], ctx: int
) -> dict[str, Any] | None:
    """The workspace a lane of `shim` at a context of `ctx` rows sizes for its chunks, as plain data; None
    where its chunks keep none (`workspace.keeps_scratch`: a knob other than `f16-scratch` and the default)
    and for the batch form, whose steps keep one or not by the GPU's free memory (`run/lane.prefill_for`)."""
    knobs = shim.knobs
    if knobs.batch or not workspace.keeps_scratch(knobs):
        return None
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    uploaded = {n: _uploaded(t) for n, t in tensors.items()}  # as `CudaLane._upload` lays them out
    _, weights = parts({n: nbytes + extra for n, (nbytes, extra) in uploaded.items()})
    surplus = sum(extra for _, extra in uploaded.values())
    relaid = sorted({t.format for n, t in tensors.items() if uploaded[n][1]}, key=int)

    def plan_at(rows: int) -> Plan:
        graph = recognizer(cfg).recognize(cfg, tensors, Form.PREFILL, rows=rows, ctx=ctx)
        return optimize(graph, shim, held=held, check=False)

    config = os.environ.get(workspace.CUBLAS_CONFIG)
    moe = workspace.one_gpu_mixture(cfg)
    ws = workspace.sized(plan_at, ctx, moe, shapes, weights, knobs, cfg.vocab, config, surplus_bytes=surplus)
    largest = max(workspace.layer_products(shapes).values())
    return {
        "ctx": ctx,
        "rows": ws.rows,
        "scratch_bytes": 2 * ws.scratch_values,
        "slabs": -(-largest // ws.scratch_values),
        "cublas_config": ws.cublas_config,
        "cublas_bytes": ws.cublas_bytes,
        "held_bytes": ws.held_bytes,
        "share_bytes": ws.share_bytes,
        "within": ws.within,
        "rounds_in_place": ws.rounds_in_place,
        "stored_surplus_bytes": surplus,
        "stored_formats": [Format(f).name for f in relaid],
    }


def _uploaded(t: Any) -> tuple[int, int]:
    """A tensor's bytes as the lane uploads it (`CudaLane._upload`), and what its stored layout adds to them: a
    vector as f32 values, a matrix as the file's bytes and its blocks' padding (`run/stored.py`)."""
    if len(t.shape) == 1:
        return F32_BYTES * math.prod(t.shape), 0
    nbytes = tensor_bytes(t.format, tuple(t.shape))
    return nbytes, stored.surplus(t.format, nbytes, stored.file_row_bytes(t.format, tuple(t.shape)))


def render_workspace(w: dict[str, Any]) -> list[str]:
    """`prefill_workspace`'s data for a terminal."""
    config = "as the process has it" if w["cublas_config"] is None else f"CUBLAS_WORKSPACE_CONFIG={w['cublas_config']}"
    cublas = f"{w['cublas_bytes'] / MB:.1f} MB" if w["cublas_bytes"] else "none"
    slabs = "whole" if w["slabs"] == 1 else f"in {w['slabs']} slabs"
    held = f"{w['share_bytes'] / MB:.1f} MB share of the weights and caches"
    verdict = "held" if w["within"] else "not held: the scratch keeps the largest product whole, for its speed"
    return [
        f"workspace (prefill=f16-scratch, a context of {w['ctx']:,} rows):",
        f"  prompts in chunks of {w['rows']} rows; their activations and outputs {w['held_bytes'] / MB:.1f} MB",
        f"  f16 scratch {w['scratch_bytes'] / MB:.1f} MB (a layer's largest product {slabs}); cuBLAS's workspace "
        f"{cublas} ({config})",
        f"  dying activations rounded to f16 in place: {'yes' if w['rounds_in_place'] else 'no'}",
        *_stored(w.get("stored_surplus_bytes", 0), w.get("stored_formats", [])),
        f"  the {held} ({round(100 * kernels.WORKSPACE_SHARE)} %): {verdict}",
    ]


def _stored(surplus: int, formats: Sequence[str]) -> list[str]:
    """The line on the weights' stored layout, where it adds to the file's bytes (`run/stored.py`): the layouts of
    the `formats` (names) that add them."""
    if not surplus:
        return []
    over = f"{surplus / MB:.1f} MB over the file, held in the share"
    return [f"  blocks stored 16-byte aligned ({stored.describe([Format[f] for f in formats])}): {over}"]

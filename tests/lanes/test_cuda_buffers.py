"""A step's activation buffers (`run/buffers.py`): activations whose lives overlap never share one, and a
deep plan's activations take far fewer buffers than it has activations."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fuselane.explain import build_plan  # noqa: E402
from fuselane.fuse.optimizer import VIEWS  # noqa: E402
from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ir import QuantizedActs, Role  # noqa: E402
from fuselane.lanes.cuda.run.buffers import lives, pooled_buffers, unstored  # noqa: E402


@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_overlapping_lives_never_share_a_buffer(form):
    _, _, plan = build_plan("synth:tiny-qwen3", lane="cuda", form=form, rows=16)
    g = plan.graph
    views = {op.out for op in plan.ops if isinstance(op.sym, VIEWS)}  # bound to their input's buffer
    acts = {n for n, t in g.tensors.items() if t.role is Role.ACTIVATION} - views - unstored(plan)
    bufs, q8 = pooled_buffers(plan, lambda s: torch.zeros(s), lambda s: torch.zeros(s, dtype=torch.int8))
    assert set(bufs) == acts and all(tuple(bufs[n].shape) == g.tensors[n].shape for n in acts)
    assert {n for n in acts if isinstance(g.tensors[n].storage, QuantizedActs)} == set(q8)
    span = lives(plan, acts)
    storage = {n: bufs[n].untyped_storage().data_ptr() for n in acts}
    for a in acts:
        for b in acts - {a}:
            (a0, a1), (b0, b1) = span[a], span[b]
            if a0 <= b1 and b0 <= a1:
                assert storage[a] != storage[b], (a, b)
                assert a not in q8 or b not in q8 or q8[a] is not q8[b], (a, b)
    assert len(set(storage.values())) < len(acts) // 2


def test_a_chunks_gated_pair_stores_only_its_glu():
    # on cuBLAS a chunk's pair joins its products' f16 tiles in its epilogue: its gate, up and SiLU take no
    # buffer; every other fused op's parts keep theirs (a GEMV in parts writes each member's output)
    _, cfg, plan = build_plan("synth:tiny-qwen3", lane="cuda", form="prefill", rows=16)
    pairs = [op for op in plan.ops if class_of(op) is C.GEMV_GATE_UP_GLU]
    inner = {leaf.out for op in pairs for leaf in leaves(op)} - {op.out for op in pairs}
    assert len(pairs) == cfg.n_layers and len(inner) == 3 * cfg.n_layers  # gate, up, the gate's SiLU
    assert unstored(plan) == inner
    bufs, _ = pooled_buffers(plan, lambda s: torch.zeros(s), lambda s: torch.zeros(s, dtype=torch.int8))
    assert not inner & set(bufs) and {op.out for op in pairs} <= set(bufs)

"""A rank's tensors and graph: the ranks' slices of a checkpoint rebuild every tensor, each rank's graph has
its slice's widths and the collectives where the partial sums meet, and splits that cannot be made are
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.errors import ModelError
from fuselane.fuse.optimizer import optimize
from fuselane.gguf.dequant import dequantize
from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import Shape, write_synthetic
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Form, Fused
from fuselane.models import config_of, recognizer
from fuselane.parallel.executor import RankShim
from fuselane.parallel.ops import AllGather, AllReduce, ExpertShard, ShardGather
from fuselane.parallel.ranks import cut, rank_config, rank_tensors

TP = 2


@pytest.fixture(scope="module", params=[("tiny-qwen3", "q8_0"), ("tiny-qwen2", "q4_0"), ("tiny-qwen3moe", "q8_0")])
def model(request, tmp_path_factory):
    shape, mix = request.param
    path = write_synthetic(tmp_path_factory.mktemp("tp") / f"{shape}.gguf", shape, mix)
    with open_gguf(path) as f:
        yield config_of(f.metadata, f.tensors), f.tensors


def _decoded(t) -> np.ndarray:
    return dequantize(t.data, t.format, t.shape, dtype=np.float64)


def test_the_ranks_slices_rebuild_every_tensor(model) -> None:
    cfg, tensors = model
    ranks = [rank_tensors(cfg, tensors, TP, r) for r in range(TP)]
    for name, t in tensors.items():
        parts = [_decoded(rk[name]) for rk in ranks]
        how = cut(name)
        if how is None:  # replicated
            for p in parts:
                np.testing.assert_array_equal(p, _decoded(t))
        else:
            np.testing.assert_array_equal(np.concatenate(parts, axis=how[0]), _decoded(t), err_msg=name)
            assert all(rk[name].nbytes < t.nbytes for rk in ranks), name


def _prims(ops):
    for op in ops:
        yield from (_prims(op.sym.parts) if isinstance(op.sym, Fused) else [op.sym])


def test_a_ranks_graph_has_its_widths_and_the_collectives(model) -> None:
    cfg, tensors = model
    rc = rank_config(cfg, TP, 1)
    assert (rc.n_heads, rc.n_kv_heads) == (cfg.n_heads // TP, cfg.n_kv_heads // TP)
    g = recognizer(rc).recognize(rc, rank_tensors(cfg, tensors, TP, 1), Form.PREFILL, rows=3, ctx=8)
    kinds = [type(s) for s in _prims(g.ops)]
    assert kinds.count(AllReduce) == 2 * cfg.n_layers + 1  # attention out, down, and the embedding
    assert kinds.count(AllGather) == 1 and kinds.count(ShardGather) == 1
    assert kinds.count(ExpertShard) == (2 * cfg.n_layers if cfg.moe else 0)
    assert g.tensors["logits"].shape == (1, cfg.vocab)
    step = recognizer(rc).recognize(rc, rank_tensors(cfg, tensors, TP, 1), Form.DECODE, ctx=8)
    plan = optimize(step, RankShim(np.dtype(np.float64)))
    fused = [f for f in plan.fired if f.cls is ClassId.ALLREDUCE_NORM]
    # a decode step's every sum meets its residual add and the next norm (a chunk's last takes its row first)
    assert len(fused) == 2 * cfg.n_layers


def test_splits_that_cannot_be_made_are_refused_by_name(tmp_path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q8_0")
    with open_gguf(path) as f:
        cfg = config_of(f.metadata, f.tensors)
        with pytest.raises(ModelError, match="--tp 3 cannot split the model's 4 attention heads evenly"):
            rank_config(cfg, 3, 0)
        with pytest.raises(ModelError, match="--tp 4 cannot split the model's 2 key/value heads evenly"):
            rank_config(cfg, 4, 0)
    narrow = Shape("qwen3", 64, 1, 8, 8, 8, 128, 512, context=64)  # heads of 8 values
    path = write_synthetic(tmp_path / "narrow.gguf", narrow, "q8_0")
    with open_gguf(path) as f:
        cfg = config_of(f.metadata, f.tensors)
        # 4 ranks: 16 values of attn_output's rows a rank, inside its 32-value Q8_0 blocks
        with pytest.raises(ModelError, match="'blk.0.attn_output.weight' splits its rows at 16 .* Q8_0"):
            rank_tensors(cfg, f.tensors, 4, 1)


@pytest.mark.parametrize("shape", ["tiny-qwen3next", "tiny-deepseek2"])
def test_a_hybrid_or_latent_model_is_refused_by_name(shape) -> None:
    from fuselane.explain import model_source

    _, cfg, _ = model_source(f"synth:{shape}")
    with pytest.raises(ModelError, match=f"--tp covers qwen2 / qwen3 and their mixtures, not {cfg.arch}"):
        rank_config(cfg, TP, 0)

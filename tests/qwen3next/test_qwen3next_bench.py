"""`fuselane bench` and `info` on a hybrid whose layers are all gated delta-rule layers: the recurrent state sums
every position and cannot go back to a depth, so the bench warms up without rewinding, and the cache line says
that no layer keeps rows a token."""

from __future__ import annotations

from dataclasses import replace

from fuselane.bench import bench_depths
from fuselane.gguf.synth import SHAPES, write_synthetic
from fuselane.info import cache_line
from fuselane.runtime.model import load


def _linear_only(tmp_path):
    shape = SHAPES["tiny-qwen3next"]
    return write_synthetic(tmp_path / "flat.gguf", replace(shape, full_every=shape.n_layers + 1), "q8_0", seed=3)


def test_bench_at_a_depth_runs_on_a_recurrent_model(tmp_path):
    path = _linear_only(tmp_path)
    results = bench_depths(str(path), lane="cpu", prompt=8, generated=3, depths=[0, 40])
    assert [r.depth for r in results] == [0, 40]
    assert all(r.prefill_tok_s > 0 and r.decode_tok_s > 0 for r in results)
    assert results[0].cache_values == "no rows a token: every layer keeps a fixed-size recurrent state"


def test_a_hybrids_cache_line_counts_its_attention_layers_alone(tmp_path):
    path = write_synthetic(tmp_path / "hybrid.gguf", "tiny-qwen3next", "q8_0", seed=3)
    cfg = load(path, lane="cpu").cfg
    full = cfg.linear.layers.count(False)
    assert 0 < full < cfg.n_layers
    assert cache_line(cfg).endswith(f"{cfg.cache_values * full:,} over {full} layers")

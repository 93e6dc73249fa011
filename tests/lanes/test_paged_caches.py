"""The cuda lane's batch form keeps each sequence's cache rows in blocks of a pool that only its paged attention
walks: a model whose plan reads a cache any other way (DeepSeek's latent cache, its values read as a slice) is
refused in one line when the batch is built, and a plan of key/value caches is taken."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fuselane.explain import build_plan  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.run.paged import cache_read_in_place  # noqa: E402


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ("tiny-deepseek2", "l0.latent_values reads the cache blk.0.latent_cache in place"),
        ("tiny-qwen3", None),
        ("tiny-qwen2moe", None),
    ],
)
def test_only_attention_reads_a_batchs_caches(tmp_path, shape, says):
    path = str(write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=1))
    _, _, plan = build_plan(path, lane="cuda", form="batch", rows=2)
    why = cache_read_in_place(plan)
    assert why == says if says is None else why.startswith(says)

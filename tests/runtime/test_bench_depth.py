"""`fuselane bench` times decode from the depth asked, as llama-bench's `tg` does: after the prompt is timed the
cache is taken back to the depth (an attention model) or filled to it again (a recurrent one)."""

from __future__ import annotations

import pytest

import fuselane.bench as bench_module
from fuselane.bench import bench
from fuselane.gguf.synth import write_synthetic


@pytest.mark.parametrize(("shape", "depth"), [("tiny-qwen3", 0), ("tiny-qwen3", 9), ("tiny-qwen3next", 6)])
def test_decode_starts_at_the_depth_not_after_the_prompt(tmp_path, monkeypatch, shape, depth):
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=2)
    starts: list[int] = []
    real_load = bench_module.load

    def spying_load(*args, **kwargs):
        m = real_load(*args, **kwargs)
        decode = m.lane.decode
        m.lane.decode = lambda token, pos, sampling: starts.append(pos) or decode(token, pos, sampling)
        return m

    monkeypatch.setattr(bench_module, "load", spying_load)
    result = bench(str(path), lane="cpu", prompt=8, generated=3, depth=depth)
    assert starts == [depth]
    assert result.decode_tok_s > 0 and result.prefill_tok_s > 0

"""`fuselane bench` times decode from the depth asked, as llama-bench's `tg` does: after the prompt is timed the
cache is taken back to the depth (an attention model) or filled to it again (a recurrent one)."""

from __future__ import annotations

import pytest

import fuselane.bench as bench_module
from fuselane.bench import bench
from fuselane.gguf.synth import write_synthetic


@pytest.mark.parametrize("generated", [bench_module.DECODE_WARM + 2, 1])
@pytest.mark.parametrize(("shape", "depth"), [("tiny-qwen3", 0), ("tiny-qwen3", 9), ("tiny-qwen3next", 6)])
def test_decode_starts_at_the_depth_not_after_the_prompt(tmp_path, monkeypatch, shape, depth, generated):
    # past the warm-up's tokens one decode loop warms up and is timed; fewer, and the warm-up (compiling, the
    # graph's capture) takes a loop of its own from the depth, so even one token is timed warm
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=2)
    starts: list[int] = []
    real_load = bench_module.load

    def spying_load(*args, **kwargs):
        m = real_load(*args, **kwargs)
        decode = m.lane.decode
        m.lane.decode = lambda token, pos, sampling: starts.append(pos) or decode(token, pos, sampling)
        return m

    monkeypatch.setattr(bench_module, "load", spying_load)
    result = bench(str(path), lane="cpu", prompt=8, generated=generated, depth=depth, repetitions=1)
    assert starts == [depth] * (1 if generated > bench_module.DECODE_WARM else 2)
    assert result.decode_tok_s > 0 and result.prefill_tok_s > 0


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-qwen3next"])
def test_the_prompt_is_timed_repetitions_times_from_the_depth(tmp_path, monkeypatch, shape):
    # llama-bench's -r: each timed run of the prompt starts at the depth; the figure is their mean
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=2)
    depth, prompt = 5, 7
    runs: list[tuple[int, int]] = []
    real_load = bench_module.load

    def spying_load(*args, **kwargs):
        m = real_load(*args, **kwargs)
        forward = m.lane.forward
        m.lane.forward = lambda ids, pos, **kw: runs.append((pos, len(ids))) or forward(ids, pos, **kw)
        return m

    monkeypatch.setattr(bench_module, "load", spying_load)
    result = bench(str(path), lane="cpu", prompt=prompt, generated=2, depth=depth, repetitions=3)
    assert result.repetitions == 3
    # three timed; an attention model's warm-ups run at the depth too, a recurrent model's from position 0
    warm = 0 if "next" in shape else bench_module.PREFILL_WARM
    assert runs.count((depth, prompt)) == 3 + warm


def test_the_peak_is_the_models_not_what_was_allocated_before():
    # a second depth's bench loads the model again: what an earlier one left allocated is not counted
    from types import SimpleNamespace

    cuda = SimpleNamespace(is_available=lambda: True, max_memory_allocated=lambda: 30_000_000_000)
    lane = SimpleNamespace(name="cuda", torch=SimpleNamespace(cuda=cuda))
    assert bench_module._peak_bytes(lane, before=12_000_000_000) == 18_000_000_000
    assert bench_module._peak_bytes(SimpleNamespace(name="cpu")) is None

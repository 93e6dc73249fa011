"""The interpreter's device calls patched once a launch (`interpreter_calls`): the same sums, far fewer patches."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
interpreter = pytest.importorskip("triton.runtime.interpreter")

from fuselane.lanes.cuda.triton import interpreter_calls  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")
ROWS, WIDTH = 4, 16


@triton.jit
def _row_peak(v):
    return tl.max(tl.abs(v), 1)  # `tl.max` is Triton's own device function, whose globals name `core`


@triton.jit
def _scaled(v, peak):
    return v / tl.where(peak > 0.0, peak, 1.0)[:, None]


@triton.jit
def _normed_kernel(x, out, ROWS: tl.constexpr, WIDTH: tl.constexpr, PASSES: tl.constexpr):
    off = tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    v = tl.load(x + off)
    for _ in tl.static_range(PASSES):  # helpers called in a loop, as the GEMVs' chunks call theirs
        v = _scaled(v, _row_peak(v))
    tl.store(out + off, v)


def _normed(x: np.ndarray, passes: int) -> np.ndarray:
    out = torch.empty(x.shape, dtype=torch.float32)
    _normed_kernel[(1,)](torch.from_numpy(x), out, ROWS=ROWS, WIDTH=WIDTH, PASSES=passes)
    return out.numpy()


def test_it_is_installed_once() -> None:
    assert getattr(interpreter.InterpretedFunction.__call__, "launch_patched", False)  # by the conftest
    assert not interpreter_calls.install()


def test_a_launch_computes_what_numpy_does_and_patches_each_module_once(monkeypatch) -> None:
    x = np.random.default_rng(3).standard_normal((ROWS, WIDTH)).astype(np.float32)
    calls = []
    patch = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__name__) or patch(fn))
    got = _normed(x, passes=3)
    want = x / np.abs(x).max(1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the kernel's module, then `triton.language.core` for `tl.max`'s: twice, not once for each of the six calls
    assert calls == ["_normed_kernel", "max"], calls


def test_a_helper_called_outside_a_launch_is_tritons_own(monkeypatch) -> None:
    calls = []
    patch = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__name__) or patch(fn))
    # a device function outside a kernel: Triton's own call, and its refusal
    with pytest.raises(interpreter.InterpreterError):
        _row_peak(torch.zeros(2, 2))
    assert calls == ["_row_peak"]

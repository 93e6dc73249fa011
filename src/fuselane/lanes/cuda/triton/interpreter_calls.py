"""Triton's interpreter, its device-function calls made cheap: each language module patched once a launch.

Under `TRITON_INTERPRET=1` each call of one `@triton.jit` function from another re-patches the language modules
its globals name (`interpreter._patch_lang`: `inspect.getmembers` over `tl`, `tl.tensor` and `tl.math`, a few
hundred members), although the launch running it has already patched the same modules with the same builder.
The lane's kernels call small helpers in their inner loops, so that scan was most of an interpreted test's time.
Here a device call patches only the modules this launch has not patched yet (Triton's own library functions name
`triton.language.core`, which a kernel's module seldom does); one already patched would find every builtin
wrapped (a wrapper is not a builtin) and re-set the tensor and core attributes to equal values, so skipping it
changes nothing a kernel computes. Outside a launch (a helper called from Python) a call is Triton's own.
"""

from __future__ import annotations

import functools

import triton.language as tl
import triton.runtime.interpreter as interpreter

LANGS = (tl, tl.core)  # the modules `_patch_lang` patches where a function's globals name them


@functools.cache
def _langs_of(fn) -> frozenset[str]:
    """The language modules `fn`'s globals name, by module name (a function's globals are its module's, so once)."""
    return frozenset(v.__name__ for v in fn.__globals__.values() if any(v is lang for lang in LANGS))


def install() -> bool:
    """Patch the interpreter once (a no-op where this Triton lacks the pieces it relies on); True if patched."""
    grid, device = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if grid is None or device is None or not hasattr(interpreter, "_patch_lang"):
        return False
    if getattr(device.__call__, "launch_patched", False):
        return False
    patched: list[set[str] | None] = [None]  # the modules the launch in progress has patched; None outside one
    launch, device_call = grid.__call__, device.__call__

    @functools.wraps(launch)
    def launch_counted(self, *args, **kwargs):
        patched[0] = set(_langs_of(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched[0] = None

    @functools.wraps(device_call)
    def device_call_in_launch(self, *args, **kwargs):
        done = patched[0]
        if done is None:
            return device_call(self, *args, **kwargs)
        if not _langs_of(self.fn) <= done:
            interpreter._patch_lang(self.fn)
            done |= _langs_of(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    device_call_in_launch.launch_patched = True
    grid.__call__, device.__call__ = launch_counted, device_call_in_launch
    return True

"""Programmatic dependent launch (compute capability 9.0+): a kernel of a step is let onto the SMs while the one
before it is still finishing, and waits for it (`griddepcontrol.wait`) before it reads what it wrote.

Why: a decode step is hundreds of short launches (the 0.5B's takes ~5 us a launch against ~0.6 us of weight
reads). Between two kernels in stream order the GPU drains the first grid, then launches the second. As a
dependent, the second grid is launched while the first runs and its blocks are placed as the first grid's
retire, so the launch and the blocks' start overlap the first grid's tail (H200 decode step: 0.5B 0.726 ->
0.619 ms, 8B 3.048 -> 2.864 ms, `benchmarks/RESULTS.md`).

The GEMVs write their first chunks' weight loads before the wait, but ptxas hoists the wait to the kernel's
top (an earlier wait is always correct): in the SASS the loads follow it. Forcing them first (the wait
predicated on a loaded value) measured +3 % on the 7B, -5 % on the 8B and -4 % on the 0.5B: each block then
waits for its weights to arrive before it waits for the grid, a round trip more where the grid before has
already ended. So the hoisted wait stays.

The contract every kernel here keeps (checked by `wait` being the first thing a kernel does, or the first
after weight loads):
- `release(PDL)` at a kernel's start lets the next grid launch once every block of this one has run it;
- `wait(PDL)` blocks until the grid before has completed and its writes are visible. Nothing before it may
  read an activation, a cache, a counter or the position, or write anything: only weights, which no kernel
  writes. As every kernel waits before it ends, a grid's completion implies all earlier grids'.
- A kernel launched without the attribute (torch's own, cuBLAS) starts after the one before it has ended, as
  always, and its successor's `wait` then waits for it.
- A few kernels read inputs before their wait. The decode attention (`attention.decode._decode_kernel`)
  reads the position and its first tile's cache rows before the position, then waits, then reads the query and
  the row at the position (which the launch just before appends). Those inputs were written before the step's
  first kernel began: the position by the host's fill (a kernel launched without the attribute) or by the
  last step's sampler, the rows by earlier steps and prefills; and between two steps there is always a graph
  replay's end or the copy of the sampled token, each of which waits for everything before it. Its blocks
  then have their first tile in flight while the launch before finishes (H200, bench tg128: 8B 392 -> 406
  tok/s, 0.6B 1,213 -> 1,277). A plain `wait` after those loads would be hoisted above them, so it sits
  behind a branch on the loaded position. The batch's paged attention (`attention.paged._paged_kernel`) does
  the same with each row's length, block table and its first tile's rows before the row's last, which the
  store launch just before writes: every other pool row was stored by an earlier step.
- The mixture's gate/up launch (`moe.gate_up`) waits before it releases, so every launch after it starts only
  once the routing launch before it has ended; the int8 down launch (`moe.down._kept_q8`) then reads the
  routing's expert ids (from L2) and its first chunks of those experts' weights before its wait, and the
  gate/up launch's activations after it.

A step whose dense products run the grid GEMV measured slower this way, not faster (H100, the 7B in IQ3_M:
119.1 against 149.7 tok/s in plain stream order, where its grid GEMV took 5.1 of 6.9 ms of kernel time either
way; the cause is not yet known), so under the `pdl` knob's `auto` such a model launches plainly
(`kernels.dependent_launch_pays`).

The lane turns it on for the launches it makes inside `dependent_launches(True)`; each launcher passes
`options()` to its kernel: the `PDL` constexpr (so a kernel compiled without it carries no griddepcontrol
instruction, for chips before Hopper) and Triton's `launch_pdl` launch attribute. Under Triton's interpreter
the instructions are skipped: the interpreter runs one program at a time, in order.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# the launches made in this context are dependents of the launch before them
_DEPENDENT = contextvars.ContextVar("fuselane_dependent_launch", default=False)


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next grid launch once every block of this one has got here."""
    if PDL and not INTERPRETED:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the grid launched before this one has completed, its writes visible."""
    if PDL and not INTERPRETED:
        gdc_wait()


@triton.jit
def begin(PDL: tl.constexpr):
    """A kernel's start where it reads nothing before its inputs: release the next grid, wait for the last."""
    release(PDL)
    wait(PDL)


@contextlib.contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Launches inside are made as dependents of the launch before them where `on`."""
    token = _DEPENDENT.set(on)
    try:
        yield
    finally:
        _DEPENDENT.reset(token)


def options() -> dict:
    """A kernel launch's arguments for the current context: the `PDL` constexpr and, where on, the launch
    attribute."""
    if _DEPENDENT.get():
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}

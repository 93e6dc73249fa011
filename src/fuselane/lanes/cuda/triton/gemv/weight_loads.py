"""How the int8 GEMVs' weight loads are held ahead of the sums they feed (the cuda lane's `weight_loads` knob).

Why: `q8.row_dots` writes each chunk's weight loads a chunk or two before its dp4a (`PREFETCH_DEPTH`), with a
`bar.sync` between them (`fast.PREFETCH_FENCE`), so a chunk's sums cover the next chunk's DRAM latency. The
weights are read on the read-only path (`ld.global.nc`, `int8_words.ld4` / `ld_run` / `ld_words`), and a
barrier does not order read-only loads, so ptxas is free to move them down to their first use: in the sm_90
SASS of the 7B's 3,584-wide Q4_K product (two chunks, no loop) the second chunk's 128-bit loads sit after the
first chunk's IDP.4A, and in the 18,944-wide Q4_K down product's loop the loads of the chunk two ahead sit
after this chunk's IDP.4A (`docs/cuda-lane.md#weight-loads` has the SASS).

- `as-written` (`AS_WRITTEN`, the default until it is timed on the GPU): the read-only loads, where ptxas
  puts them.
- `ahead` (`AHEAD`): the weights take the coherent path (`ld.global.L1::evict_first`, the same L1 policy),
  which a `bar.sync` does order, and a barrier follows the loads of the first chunks too (the straight-line
  kernels of one or two chunks have no loop barrier). The same bytes are summed in the same order, so the
  numbers are bit for bit the same.

The lane makes its launches inside `weight_loads(mode)`; each int8 GEMV launcher reads `fence()` into the
kernels' `FENCE` constexpr: `NO_FENCE`, `FENCED` (a barrier in the loop) or `PINNED` (coherent loads, a
barrier after the prologue's and after each prefetch).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from fuselane.lanes.cuda.plan.knobs import WeightLoads

NO_FENCE, FENCED, PINNED = 0, 1, 2  # the `FENCE` constexpr's values (False and True are the first two)
_MODE = contextvars.ContextVar("fuselane_weight_loads", default=WeightLoads.AS_WRITTEN)


@contextlib.contextmanager
def weight_loads(mode: WeightLoads) -> Iterator[None]:
    """The int8 GEMVs launched inside load their weights as `mode` says."""
    token = _MODE.set(WeightLoads(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def fence(prefetch_fence: bool) -> int:
    """The `FENCE` constexpr of an int8 GEMV launched now: PINNED under `ahead`, else FENCED or NO_FENCE as
    `prefetch_fence` (`fast.PREFETCH_FENCE`) says."""
    if _MODE.get() is WeightLoads.AHEAD:
        return PINNED
    return FENCED if prefetch_fence else NO_FENCE

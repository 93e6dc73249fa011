"""The lanes that run batches of sequences: each lane's paged form, by lane name.

A lane joins the engine (and `fuselane serve`) by adding its class here (see `fuselane.engine.lane`).
"""

from __future__ import annotations

from fuselane.engine.cpu import CpuPaged
from fuselane.engine.cuda import CudaPaged
from fuselane.engine.lane import PagedLaneType
from fuselane.errors import FuselaneError


def paged_lanes() -> dict[str, PagedLaneType]:
    """The lanes that step batches of sequences, by lane name."""
    return {"cpu": CpuPaged, "cuda": CudaPaged}


def paged_type(lane: str) -> PagedLaneType:
    """The paged form of the lane called `lane`, or a one-line error naming the lanes that have one."""
    table = paged_lanes()
    if lane not in table:
        raise FuselaneError(f"the {lane} lane does not run batches of sequences yet; use --lane {' or '.join(table)}")
    return table[lane]

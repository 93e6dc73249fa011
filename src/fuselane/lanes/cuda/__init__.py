"""The cuda lane: Triton kernels on an NVIDIA GPU, with torch for device memory, streams and CUDA graphs.

Two halves: `plan` (knobs, kernel facts, the shim, fits and the lane's rules) is plain Python and imports
neither torch nor Triton, so a plan is built and explained on a machine without a GPU; `run` (the lane, the
class -> binder table, the decode loop) binds a plan to launches and loads torch, and the kernels in
`triton` on first bind.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "CudaLane":  # torch loads only when the lane is asked for
        from fuselane.lanes.cuda.run.lane import CudaLane

        return CudaLane
    raise AttributeError(f"module 'fuselane.lanes.cuda' has no attribute {name!r}")

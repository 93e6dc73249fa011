"""The cuda lane: Triton kernels on an NVIDIA GPU, with torch for device memory, streams and CUDA graphs.

This package's compiler side (`knobs`, `kernels`, `shim`) is plain Python and imports neither torch nor
triton, so a plan can be built and explained on a machine without a GPU; the modules that launch kernels
load those libraries lazily, on first use.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "CudaLane":  # torch loads only when the lane is asked for
        from fuselane.lanes.cuda.lane import CudaLane

        return CudaLane
    raise AttributeError(f"module 'fuselane.lanes.cuda' has no attribute {name!r}")

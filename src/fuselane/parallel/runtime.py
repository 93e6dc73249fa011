"""`fuselane.load(..., tp=N)`: what a split load checks, and why no lane runs one yet.

Every rank's split is checked first (heads, widths and experts divide; every column split falls on its
format's blocks), so a model that cannot be split says so by name. Then the lane answers: the cpu lane runs
a model in one process and does not split it; the cuda lane's shim says whether it runs the collectives, and
until it has a launch for them it refuses with its reason. The rank logic itself runs on CPU processes
(`processes.rank_logits`), which is how it is tested.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.fuse.optimizer import check_runs
from fuselane.graph.ir import Form
from fuselane.models import ModelConfig, recognizer
from fuselane.parallel.ranks import rank_config, rank_shapes

CHECK_CTX = 16  # cache rows of the rank graph the lane is asked about: its collectives do not depend on them


def refuse_split(cfg: ModelConfig, tensors: Mapping[str, Any], tp: int, lane: str) -> None:
    """Raise the one-line reason `lane` (cpu or cuda, resolved) cannot run `cfg` split over `tp` ranks."""
    shapes = [rank_shapes(cfg, tensors, tp, rank) for rank in range(tp)]
    if lane == "cpu":
        raise FuselaneError(f"the cpu lane runs a model in one process and does not split it; --tp {tp} needs GPUs")
    from fuselane.lanes.cuda.plan.shim import CudaShim

    rc = rank_config(cfg, tp, 0)
    check_runs(recognizer(rc).recognize(rc, shapes[0], Form.DECODE, ctx=CHECK_CTX), CudaShim())
    raise FuselaneError(f"the cuda lane has no launch for a rank of --tp {tp} yet")  # a shim that took it

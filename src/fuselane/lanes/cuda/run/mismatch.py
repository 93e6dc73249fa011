"""The run side's one error of its own: a plan op its binders cannot launch as the plan says (a lane bug, not
bad input), raised by `launch` and by the binders of each family (`moe_launch`)."""

from __future__ import annotations

from fuselane.errors import FuselaneError


class PlanMismatch(FuselaneError):
    """An op the plan holds that this lane's binders do not launch as the plan says: a bug of the lane."""

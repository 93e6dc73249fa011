"""The GPU tests' grouping under pytest-xdist: the anchor-shape tests of one (shape, context depth) run on one
worker, which builds that shape's checkpoint and f64 reference once for them. By shape alone, a worker took both
depths of the 7B or the 8B (its long reference prefills 2,048 tokens in f64) and set the run's length; by
(shape, depth) the long references spread over the workers, each shape's build made twice."""

from __future__ import annotations

import pytest

ANCHOR_MODULE = "test_anchor_shapes.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", None)
        if item.path.name != ANCHOR_MODULE or not params or "anchor" not in params:
            continue
        shape = params["anchor"][0]
        depth = params.get("depth", 0)  # the greedy test feeds the short prompt: depth 0's group
        item.add_marker(pytest.mark.xdist_group(f"anchor-{shape}-{depth}"))

"""The rule over DeepSeek's grouped routing: the router product, its choice scores, the top-k within the best
groups and the kept experts' weights as one op (`GroupedTopk`), where nothing else reads the scores.

A lane routes a row in one launch only where it ranks groups before experts; the cuda lane routes by one top-k
over every expert and refuses the class (so the model, which cannot route without it, does not run there).
"""

from __future__ import annotations

from fuselane.fuse.moe_rules import internal
from fuselane.fuse.patterns import op_at
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rule import Rule
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ops import ExpertChoice, GroupedTopK, Matmul, RouteWeights


def grouped_topk(r: Rewriter, i: int) -> None:
    if op_at(r, i, Matmul) is None:
        return
    scores = r.s.get(i).out
    readers = [j for j in r.s.readers(scores) if j > i]
    choice = next((j for j in readers if op_at(r, j, ExpertChoice)), None)
    weights = next((j for j in readers if op_at(r, j, RouteWeights)), None)
    if choice is None or weights is None:
        return
    top = next((j for j in r.s.readers(r.s.get(choice).out) if op_at(r, j, GroupedTopK)), None)
    if top is None or r.s.get(weights).ins[1] != r.s.get(top).out:
        return
    members = sorted([i, choice, top, weights])
    if internal(r, "grouped_topk", members, [i, choice]):  # the kept experts and weights are its results
        r.try_fuse("grouped_topk", C.GROUPED_TOPK, members, weights)


ROUTING_RULES = [
    # RouteWeights(x @ Wr^T, GroupedTopK(choice(x @ Wr^T))) -> GroupedTopk writes the kept experts and weights
    Rule("grouped_topk", (C.GROUPED_TOPK,), grouped_topk),
]

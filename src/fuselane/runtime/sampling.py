"""Choosing the next token from logits: arg-max, or temperature with top-k and top-p, from a seeded generator.

The order is llama.cpp's and Hugging Face's: top-k, then temperature, then top-p over what is left. The same
seed, prompt and settings give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.ranges import SEED, TEMPERATURE, TOP_K, TOP_P


def nan_logits(lane: str) -> str:
    """What a sampler says of NaN logits, on the host or read from the device's flag: which lane made them, and
    how to tell the lane's own overflow from a broken file (the cpu lane is the reference)."""
    if lane == "cpu":
        return "the cpu lane computed NaN logits: the file's weights or metadata are broken (or overflow f32)"
    return f"the {lane} lane computed NaN logits; if `--lane cpu` gives finite ones, its own numbers overflowed"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 switch those filters off; seed None draws one."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def __post_init__(self) -> None:
        # the command line's bounds: NaN would make every probability NaN, an infinite temperature samples
        # uniformly, numpy's generators take only non-negative seeds
        TEMPERATURE.check(self.temperature)
        TOP_K.check(self.top_k)
        TOP_P.check(self.top_p)
        if self.seed is not None:
            SEED.check(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """Picks tokens under one set of parameters, drawing from its own generator."""

    def __init__(self, params: SamplingParams, lane: str = "cpu") -> None:
        self.params, self.lane = params, lane
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if np.isnan(logits).any():
            # arg-max would quietly pick a NaN's index and sampling would fail inside numpy
            raise FuselaneError(nan_logits(self.lane))
        if p.greedy:
            return int(np.argmax(logits))
        candidates = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            candidates = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        chosen = logits[candidates]
        order = np.argsort(-chosen, kind="stable")
        candidates, chosen = candidates[order], chosen[order]
        # temperature scales the gaps below the best logit, not the logits: the gaps are <= 0, so a tiny
        # temperature sends them to -inf (probability 0) where logits / T would overflow to inf - inf = NaN
        probs = np.exp((chosen - chosen[0]) / p.temperature)
        probs /= probs.sum()
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
        return int(candidates[self.rng.choice(probs.size, p=probs)])

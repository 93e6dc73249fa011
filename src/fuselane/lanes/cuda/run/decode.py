"""The cuda lane's decode loop: a decode step that ends with the device sampler and feeds itself, replayed one
step ahead of the host's reads.

A decode step's launches are followed by a sampler's (a "tail": the arg-max for greedy, the candidates and a
seeded draw otherwise, `triton.sample`), which writes the picked token into the step's own input-id buffer and
advances its position buffer. The step with its tail is captured as one CUDA graph, so a replay computes the
logits, picks the token and leaves the next step's inputs in place: after the first step's token and position
the host writes nothing, and it reads only the 8-byte pick (token and NaN flag), never the logits.

Graphs: one per tail. Greedy has its own; sampling has one per number of candidates (top-k, a shape), while
temperature, top-p and the seed are device values written when a loop starts, so another temperature or seed
replays the same graph. The plain step `forward` runs (prefill's last chunk, the logits API) is another.

Lookahead: step t+1 is replayed before the host reads step t's token; each step's pick is copied to its own
pinned host slot behind an event, so the host waits for that step alone while the GPU runs the next. When the
consumer stops (a stop token, enough tokens), the step after the last token read has already run: it wrote
the cache row of that token, one row past what the session holds, and the next feed at that position
overwrites it before any attention reads it. No step runs at a position past the cache.

A model with recurrent state (Qwen3-Next) runs no step ahead: a step sums its token into the state, which no
later feed can take back, so a token is fed only when the next one is asked for (as on the cpu lane); the
lane's states start again at position 0 and continue only where they stopped (`CudaLane.continue_at`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.lanes.cuda.run.launch import Launch
from fuselane.models import ModelConfig
from fuselane.runtime.sampling import SamplingParams, nan_logits

# Host slots of picks in flight: the step being read and the one queued after it.
SLOTS = 2
GREEDY_KEY = ("argmax",)


class Step(Protocol):
    """What the loop runs of a decode step (`lane._Step`): feed it the first token, launch it with a tail."""

    def feed(self, token: int, pos: int) -> None: ...

    def launch(self, tail: Tail | None = None) -> None: ...


class CudaLane(Protocol):
    """What the loop and the sampler read of the lane (`lane.CudaLane`, which calls them): a protocol, so this
    module does not import the lane back."""

    torch: Any
    device: Any
    ctx: int
    cfg: ModelConfig

    def step(self, rows: int, *, all_logits: bool = False) -> Step: ...

    def sampler(self) -> DeviceSampler: ...

    @property
    def recurrent(self) -> bool: ...

    def continue_at(self, pos: int) -> None: ...

    def fed(self, pos: int) -> None: ...


@dataclass(slots=True)
class Tail:
    """The sampler launches a decode step ends with, for one kind of sampling."""

    key: tuple[Any, ...]  # which graph the step with this tail is captured as
    launches: list[Launch]
    state: tuple[Any, ...]  # device values the launches advance: put back after a capture's warm-up run


class DeviceSampler:
    """The sampler's device buffers, bound to the decode step's logits, input id and position, and the pinned
    host slots its picks are read from."""

    def __init__(self, lane: CudaLane, logits: Any, ids: Any, pos: Any) -> None:
        from fuselane.lanes.cuda.triton import sample

        torch, device = lane.torch, lane.device
        self.torch, self.sample = torch, sample
        self.logits, self.ids, self.pos = logits, ids, pos
        self.vocab = logits.numel()
        self.picked = sample.new_picked(device)
        self.scratch = sample.argmax_scratch(self.vocab, device)
        self.params = torch.zeros(sample.PARAMS_VALUES, dtype=torch.float32, device=device)
        self.rng = torch.zeros(sample.RNG_VALUES, dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        # pinned, so the copies are asynchronous (not on an interpreted lane, whose device is the host)
        self.host = torch.zeros((SLOTS, self.picked.numel()), dtype=self.picked.dtype, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() for _ in range(SLOTS)] if self.cuda else []
        self._tails: dict[tuple[Any, ...], Tail] = {}

    def candidates(self, sampling: SamplingParams) -> int:
        """How many candidates a draw under `sampling` picks from: top-k, or the whole vocabulary."""
        return sampling.top_k if 0 < sampling.top_k < self.vocab else self.vocab

    def tail(self, sampling: SamplingParams) -> Tail:
        """The launches that pick the next token under `sampling`, made once per graph they belong to."""
        key = GREEDY_KEY if sampling.greedy else ("sample", self.candidates(sampling))
        if key not in self._tails:
            self._tails[key] = self._greedy() if sampling.greedy else self._sampling(self.candidates(sampling))
        return self._tails[key]

    def _greedy(self) -> Tail:
        s, logits, picked, scratch, ids, pos = self.sample, self.logits, self.picked, self.scratch, self.ids, self.pos
        return Tail(GREEDY_KEY, [lambda: s.argmax_token(logits, picked, scratch, ids=ids, pos=pos)], (ids, pos))

    def _sampling(self, k: int) -> Tail:
        torch, s = self.torch, self.sample
        vals = torch.empty(k, dtype=torch.float32, device=self.logits.device)
        idx = torch.empty(k, dtype=torch.int64, device=self.logits.device)
        logits, params, rng, picked, ids, pos = self.logits, self.params, self.rng, self.picked, self.ids, self.pos
        launches = [
            lambda: s.candidates(logits, vals, idx),
            lambda: s.sample_token(vals, idx, params, rng, picked, ids=ids, pos=pos),
        ]
        return Tail(("sample", k), launches, (ids, pos, rng))

    def arm(self, sampling: SamplingParams) -> None:
        """Write a loop's sampling values to the device: temperature, top-p, the seed, the counter at zero.
        The seed goes through numpy's SeedSequence (any non-negative int, or None for fresh entropy) to the
        64 bits Philox takes."""
        torch, s = self.torch, self.sample
        if sampling.greedy:
            return
        params = [0.0] * s.PARAMS_VALUES
        params[s.TEMPERATURE], params[s.TOP_P] = sampling.temperature, sampling.top_p
        self.params.copy_(torch.tensor(params, dtype=torch.float32))
        seed = np.random.SeedSequence(sampling.seed).generate_state(1, np.uint64).view(np.int64)[0]
        rng = [0] * s.RNG_VALUES
        rng[s.SEED] = int(seed)
        self.rng.copy_(torch.tensor(rng, dtype=torch.int64))

    def issue(self, slot: int) -> None:
        """Copy the pick just made to host slot `slot`, behind an event (queued after the step that made it)."""
        self.host[slot].copy_(self.picked, non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()

    def read(self, slot: int) -> int:
        """The token in host slot `slot`, once its copy is done; a NaN in its step's logits is an error, as the
        host sampler's."""
        if self.cuda:
            self.events[slot].synchronize()
        picked = self.host[slot].tolist()
        if picked[self.sample.NAN_FLAG]:
            raise FuselaneError(nan_logits("cuda"))
        return int(picked[self.sample.TOKEN])


def decode(lane: CudaLane, token: int, pos: int, sampling: SamplingParams) -> Iterator[int]:
    """`CudaLane.decode`: feed `token` at `pos`, then yield each next token as the device samples it."""
    if not 0 <= pos < lane.ctx:
        raise ValueError(f"position {pos} is outside the cache of {lane.ctx}")
    if not 0 <= token < lane.cfg.vocab:
        raise ValueError(f"token {token} is outside the vocabulary of {lane.cfg.vocab}")
    return _steps(lane, token, pos, sampling)


def _steps(lane: CudaLane, token: int, pos: int, sampling: SamplingParams) -> Iterator[int]:
    step, sampler = lane.step(1), lane.sampler()
    ahead = not lane.recurrent  # a recurrent state cannot take back a step run ahead
    lane.continue_at(pos)
    tail = sampler.tail(sampling)
    sampler.arm(sampling)
    step.feed(token, pos)  # the loop's only host values: every later input is the sampler's write

    def issue(n: int) -> None:
        step.launch(tail)
        sampler.issue(n % SLOTS)
        lane.fed(pos + n + 1)

    issue(0)
    n = 0
    while True:
        if ahead and pos + n + 1 < lane.ctx:
            issue(n + 1)  # one step ahead: the GPU runs it while the host reads this one's token
        yield sampler.read(n % SLOTS)
        n += 1
        if pos + n >= lane.ctx:
            return
        if not ahead:
            issue(n)

"""`fuselane bench`: prefill and decode tokens/s of a model on a lane, llama-bench style.

Prefill (`pp`) times a prompt of random tokens run in the lane's chunks; decode (`tg`) times greedy generation
through the lane's decode loop, as a user gets it (on the cuda lane: a graph replay a token, the sampler on the
device, no logits copied to the host), after `depth` tokens already in the cache. The decode figure is set
against the lane's limit: every weight read once a token at the machine's measured copy bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY

COPY_BYTES = 1 << 30  # bytes moved to measure the memory bandwidth
COPY_REPEATS = 5
SEED = 1234
# Tokens read before decode is timed: the decode step's first runs compile its kernels and capture its graph.
DECODE_WARM = 3
# Runs of a whole prefill chunk before prefill is timed: compiling, then a lane's capture of the chunk as a graph.
PREFILL_WARM = 3


@dataclass(frozen=True, slots=True)
class BenchResult:
    model: str
    lane: str
    size_gb: float
    prompt: int
    generated: int
    depth: int
    prefill_tok_s: float
    decode_tok_s: float
    launches_per_token: int | None
    weight_gb_per_token: float
    bandwidth_gb_s: float
    limit_tok_s: float
    percent_of_limit: float


def _copy_bandwidth(lane: Any) -> float:
    """Bytes a second the lane's memory moves in a plain copy, counting both the read and the write."""
    if getattr(lane, "name", "") == "cuda":
        torch = lane.torch
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=lane.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(COPY_REPEATS):
            dst.copy_(src)
        torch.cuda.synchronize()
        return 2 * COPY_BYTES * COPY_REPEATS / (time.perf_counter() - start)
    src = np.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(COPY_REPEATS):
        np.copyto(dst, src)
    return 2 * src.nbytes * COPY_REPEATS / (time.perf_counter() - start)


def _sync(lane: Any) -> None:
    if getattr(lane, "name", "") == "cuda":
        lane.torch.cuda.synchronize()


def bench(
    model: str,
    *,
    lane: str = "auto",
    prompt: int = 512,
    generated: int = 128,
    depth: int = 0,
    knobs: Sequence[str] = (),
) -> BenchResult:
    """Measure one model on one lane under its `knobs` (see the module docstring)."""
    ctx = depth + prompt + generated + 1
    m = load(model, lane=lane, ctx=ctx, knobs=knobs)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, min(m.cfg.vocab, m.tokenizer.vocab_size), size=depth + prompt + generated)
    session = m.session()
    if depth:
        session.extend(tokens[:depth].tolist())
    # first runs of a whole chunk compile the kernels, make what prefill uses and let a lane capture the chunk
    # as a graph; their cache rows are rewritten
    for _ in range(PREFILL_WARM):
        session.extend(tokens[depth : depth + min(prompt, session.chunk)].tolist())
        session.tokens = session.tokens[:depth]
    _sync(m.lane)
    start = time.perf_counter()
    session.extend(tokens[depth : depth + prompt].tolist())
    _sync(m.lane)
    prefill = prompt / (time.perf_counter() - start)
    steps = m.lane.decode(int(tokens[depth + prompt]), len(session.tokens), GREEDY)
    warm = min(DECODE_WARM, generated)
    for _ in range(warm):
        next(steps)
    # not synchronized first: the loop keeps a step queued ahead of the token it reads, as it does for a user
    start = time.perf_counter()
    for _ in range(generated - warm):
        next(steps)
    elapsed = time.perf_counter() - start
    steps.close()
    _sync(m.lane)
    decode = (generated - warm) / elapsed if generated > warm else float("nan")
    weight_bytes = _weight_bytes(m)
    bandwidth = _copy_bandwidth(m.lane)
    limit = bandwidth / weight_bytes
    launches = m.lane.launches_per_token() if hasattr(m.lane, "launches_per_token") else None
    return BenchResult(
        model=m.path.name,
        lane=m.lane.shim.name,  # the lane at its knobs: "cuda:H200:int8", "cpu:float32"
        size_gb=round(m.file.size / 1e9, 2),
        prompt=prompt,
        generated=generated,
        depth=depth,
        prefill_tok_s=round(prefill, 1),
        decode_tok_s=round(decode, 1),
        launches_per_token=launches,
        weight_gb_per_token=round(weight_bytes / 1e9, 3),
        bandwidth_gb_s=round(bandwidth / 1e9, 1),
        limit_tok_s=round(limit, 1),
        percent_of_limit=round(100 * decode / limit, 1),
    )


def _weight_bytes(m: Any) -> int:
    """Bytes one decode step must read: every matrix the lane multiplies by, not the gathered embedding."""
    if hasattr(m.lane, "weight_bytes"):
        return m.lane.weight_bytes()
    if hasattr(m.lane, "dequantized_bytes"):
        m.lane.warm()
        return m.lane.dequantized_bytes()
    return sum(t.nbytes for n, t in m.file.tensors.items() if n != "token_embd.weight")


def render(results: list[BenchResult]) -> str:
    """A llama-bench-like table."""
    head = "| model | size | lane | test | t/s | launches/token | % of limit |"
    lines = [head, "|" + "---|" * 7]
    for r in results:
        at = f" @ d{r.depth}" if r.depth else ""
        lines.append(f"| {r.model} | {r.size_gb} GB | {r.lane} | pp{r.prompt}{at} | {r.prefill_tok_s:,.1f} | | |")
        lines.append(
            f"| {r.model} | {r.size_gb} GB | {r.lane} | tg{r.generated}{at} | {r.decode_tok_s:,.1f} | "
            f"{r.launches_per_token if r.launches_per_token is not None else ''} | {r.percent_of_limit} % |"
        )
    return "\n".join(lines)


def as_json(results: list[BenchResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]

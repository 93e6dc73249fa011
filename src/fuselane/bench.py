"""`fuselane bench`: prefill and decode tokens/s of a model on a lane, llama-bench style, and on the cuda lane
the most GPU memory the model took (`torch.cuda.max_memory_allocated`, from its load to its last token).

Prefill (`pp`) times a prompt of random tokens run in the lane's chunks, `repetitions` times from the same depth
(the mean of their tokens/s, as llama-bench's `-r`); decode (`tg`) times greedy generation
through the lane's decode loop, as a user gets it (on the cuda lane: a graph replay a token, the sampler on the
device, no logits copied to the host). Both start from `depth` tokens already in the cache, as llama-bench's
`pp` and `tg` tests do: decode is timed after the cache is taken back to the depth, not after the prompt (a
recurrent model, whose state cannot go back, fills the depth again in a session of its own). The sizes are
checked against the model's context before anything runs.

The decode figure is set against the lane's limit: the tokens a second it could reach if a step did nothing but
read every weight once. On the cuda lane the weights' bytes are set against the device's measured copy
bandwidth. On the cpu lane the limit is measured on the lane's own weights, read once each by a product with a
vector (best of a few passes): a decode step reads them the same way and does more besides, so it cannot beat
the limit, where a bandwidth measured on a buffer of another size could (weights that fit in the CPU's caches
read faster than a copy through memory).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.info import cache_line
from fuselane.ranges import DEFAULT_BENCH_REPETITIONS
from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY

COPY_BYTES = 1 << 30  # bytes moved to measure the memory bandwidth
COPY_REPEATS = 5
SEED = 1234
PEAK_DIGITS = 3  # the peak in GB to the MB: a 0.5B's 5 % share is ~25 MB, too fine for tens of MB
# Tokens read before decode is timed: the decode step's first runs compile its kernels and capture its graph.
DECODE_WARM = 3
# Runs of a whole prefill chunk before prefill is timed: compiling, then a lane's capture of the chunk as a graph.
PREFILL_WARM = 3
# Passes over the cpu lane's weights when its limit is measured; the fastest counts.
LIMIT_PASSES = 5
# Cache rows past depth + prompt + generated: the decode loop's first step feeds a token of its own.
DECODE_ROW = 1


@dataclass(frozen=True, slots=True)
class BenchResult:
    model: str
    lane: str
    size_gb: float
    prompt: int
    generated: int
    depth: int
    prefill_tok_s: float  # the mean of `repetitions` timed runs of the prompt
    decode_tok_s: float
    launches_per_token: int | None
    weight_gb_per_token: float
    bandwidth_gb_s: float
    limit_tok_s: float
    percent_of_limit: float
    peak_gpu_gb: float | None  # the most GPU memory the model took, load to last token (None on the cpu lane)
    cache_values: str = ""  # what the cache holds a token a layer (`cache_line`)
    repetitions: int = DEFAULT_BENCH_REPETITIONS  # timed runs of the prompt
    # how the cuda lane's prefill products read the weights, as it runs them (`prefill=auto` taken: f16-scratch
    # unless a knob says otherwise), which the peak depends on; empty on the cpu lane
    prefill: str = ""
    # the peak over what the model holds beside its workspace (its weights, caches and states at the bench's
    # context), in %: the workspace's share, which the cuda lane keeps within 5 % where it can; None on the cpu lane
    peak_over_pct: float | None = None
    chunk_rows: int = 0  # the rows the prompt ran in a chunk at (llama-bench's ubatch)
    # whether the cuda lane launched each kernel as a dependent of the one before (`pdl`); None on the cpu lane
    dependent_launches: bool | None = None


def _copy_bandwidth(lane: Any) -> float:
    """Bytes a second the cuda lane's memory moves in a plain copy, counting both the read and the write."""
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


def _read_seconds(weights: Sequence[np.ndarray]) -> float:
    """The fastest of LIMIT_PASSES passes reading each of `weights` once, by a product with a vector."""
    vectors = {w.shape[-1]: np.ones(w.shape[-1], dtype=w.dtype) for w in weights if w.ndim}
    best = float("inf")
    for _ in range(LIMIT_PASSES):
        start = time.perf_counter()
        for w in weights:
            if w.ndim:
                np.dot(w.reshape(-1, w.shape[-1]), vectors[w.shape[-1]])
        best = min(best, time.perf_counter() - start)
    return best


def _limit(m: Any) -> tuple[int, float, float]:
    """The weight bytes a decode step reads, the bandwidth they are read at, and the tokens/s limit."""
    if getattr(m.lane, "name", "") == "cuda":
        weight_bytes, bandwidth = m.lane.weight_bytes(), _copy_bandwidth(m.lane)
        return weight_bytes, bandwidth, bandwidth / weight_bytes
    weights = _cpu_weights(m)
    weight_bytes = sum(w.nbytes for w in weights)
    seconds = _read_seconds(weights)
    return weight_bytes, weight_bytes / seconds, 1 / seconds


def _sync(lane: Any) -> None:
    if getattr(lane, "name", "") == "cuda":
        lane.torch.cuda.synchronize()


def rows_needed(prompt: int, generated: int, depth: int) -> int:
    """Cache rows one bench uses: the depth, the prompt, the generated tokens (or the decode warm-up's, where
    more) and the decode loop's own row."""
    return depth + prompt + max(generated, DECODE_WARM) + DECODE_ROW


def check_sizes(model: str | None, prompt: int, generated: int, depths: Sequence[int]) -> None:
    """Refuse, before anything runs, sizes whose rows pass the model's context (read from its header)."""
    from fuselane.gguf.reader import open_gguf
    from fuselane.hub import resolve
    from fuselane.models import config_of

    if prompt < 1 or generated < 1 or min(depths, default=0) < 0:
        raise FuselaneError(f"bench needs a prompt and generated tokens >= 1, depths >= 0, not {prompt}, {generated}")
    with open_gguf(resolve(model)) as f:
        context = config_of(f.metadata, f.tensors).context
    deepest = max(depths, default=0)
    need = rows_needed(prompt, generated, deepest)
    if need > context:
        raise FuselaneError(
            f"depth {deepest} + prompt {prompt} + generated {max(generated, DECODE_WARM)} + 1 = {need:,} cache rows, "
            f"more than the model's context of {context:,} tokens"
        )


def bench_depths(
    model: str | None,
    *,
    lane: str = "auto",
    prompt: int = 512,
    generated: int = 128,
    depths: Sequence[int] = (0,),
    knobs: Sequence[str] = (),
    repetitions: int = DEFAULT_BENCH_REPETITIONS,
) -> list[BenchResult]:
    """One bench a depth, every size checked against the model's context first."""
    check_sizes(model, prompt, generated, depths)
    return [
        bench(model, lane=lane, prompt=prompt, generated=generated, depth=d, knobs=knobs, repetitions=repetitions)
        for d in depths
    ]


def _warm_then_fill(m: Any, tokens: np.ndarray, depth: int, prompt: int, step: Any) -> Any:
    """A recurrent model's warm-up: its state sums every position and cannot go back to the depth, so the
    warm-up chunks run from position 0 in sessions of their own, and the session timed fills the depth after."""
    step("prefill warm-up")
    for _ in range(PREFILL_WARM):
        warm = m.session()
        warm.extend(tokens[: min(prompt, warm.chunk)].tolist())
        step(advance=1)
    return _filled(m, tokens, depth)


def _filled(m: Any, tokens: np.ndarray, depth: int) -> Any:
    """A new session holding the first `depth` tokens."""
    session = m.session()
    if depth:
        session.extend(tokens[:depth].tolist())
    return session


def _warm_decode(m: Any, session: Any, tokens: np.ndarray, depth: int, prompt: int, generated: int) -> tuple:
    """The decode loop from the depth and the tokens of it already run: its first steps compile the kernels and
    capture the step's graph, so `DECODE_WARM` of them are not timed. Where fewer tokens are asked for than that
    and one, the warm-up runs in a loop of its own, which the cache is then taken back from."""
    first = int(tokens[depth + prompt])
    steps = m.lane.decode(first, len(session.tokens), GREEDY)
    if generated > DECODE_WARM:
        for _ in range(DECODE_WARM):
            next(steps)
        return steps, DECODE_WARM
    for _ in range(DECODE_WARM):
        next(steps)
    steps.close()
    _sync(m.lane)
    session = _back_to_depth(m, session, tokens, depth)
    return m.lane.decode(first, len(session.tokens), GREEDY), 0


def _back_to_depth(m: Any, session: Any, tokens: np.ndarray, depth: int) -> Any:
    """The session decode starts from: `depth` tokens in the cache (llama-bench's `tg` at that depth). An
    attention cache is taken back (rows past the depth are rewritten as decode goes); a recurrent state sums
    every position, so a session of its own fills the depth again."""
    if not getattr(m.lane, "recurrent", False):
        session.tokens = session.tokens[:depth]
        return session
    return _filled(m, tokens, depth)


def bench(
    model: str | None,
    *,
    lane: str = "auto",
    prompt: int = 512,
    generated: int = 128,
    depth: int = 0,
    knobs: Sequence[str] = (),
    repetitions: int = DEFAULT_BENCH_REPETITIONS,
) -> BenchResult:
    """Measure one model on one lane under its `knobs` (see the module docstring)."""
    with _progress(f"pp{prompt} tg{generated} @ d{depth}") as step:
        step("loading")
        before = _reset_peak(lane)
        m = load(model, lane=lane, ctx=rows_needed(prompt, generated, depth), knobs=knobs)
        on_cpu = getattr(m.lane, "name", "") == "cpu"
        rng = np.random.default_rng(SEED)
        tokens = rng.integers(0, min(m.cfg.vocab, m.tokenizer.vocab_size), size=depth + prompt + generated)
        step("filling the cache to the depth", total=PREFILL_WARM + repetitions + generated + 1)
        if getattr(m.lane, "recurrent", False):
            session = _warm_then_fill(m, tokens, depth, prompt, step)
        else:
            session = _filled(m, tokens, depth)
            # first runs of a whole chunk compile the kernels, make what prefill uses and let a lane capture the
            # chunk as a graph; their cache rows are rewritten
            step("prefill warm-up")
            for _ in range(PREFILL_WARM):
                session.extend(tokens[depth : depth + min(prompt, session.chunk)].tolist())
                session.tokens = session.tokens[:depth]
                step(advance=1)
        step(f"pp{prompt}")
        rates = []
        for rep in range(repetitions):
            if rep:
                session = _back_to_depth(m, session, tokens, depth)
            _sync(m.lane)
            start = time.perf_counter()
            session.extend(tokens[depth : depth + prompt].tolist())
            _sync(m.lane)
            rates.append(prompt / (time.perf_counter() - start))
            step(advance=1)
        prefill = float(np.mean(rates))
        step(f"tg{generated}")
        session = _back_to_depth(m, session, tokens, depth)
        steps, warm = _warm_decode(m, session, tokens, depth, prompt, generated)
        step(advance=warm)
        # not synchronized first: the loop keeps a step queued ahead of the token it reads, as it does for a user
        start = time.perf_counter()
        for _ in range(generated - warm):
            next(steps)
            if on_cpu:  # a cpu step takes milliseconds; on the device a tick would show in the figure
                step(advance=1)
        elapsed = time.perf_counter() - start
        steps.close()
        _sync(m.lane)
        decode = (generated - warm) / elapsed
        peak = _peak_bytes(m.lane, before)  # before the limit's copy buffers, which are the bench's, not the model's
        step("the lane's limit", advance=0 if on_cpu else generated - warm)
        weight_bytes, bandwidth, limit = _limit(m)
        step(advance=1)
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
        repetitions=repetitions,
        launches_per_token=launches,
        weight_gb_per_token=round(weight_bytes / 1e9, 3),
        bandwidth_gb_s=round(bandwidth / 1e9, 1),
        limit_tok_s=round(limit, 1),
        percent_of_limit=round(100 * decode / limit, 1),
        peak_gpu_gb=None if peak is None else round(peak / 1e9, PEAK_DIGITS),
        cache_values=cache_line(m.cfg),
        prefill=_prefill(m.lane),
        peak_over_pct=None if peak is None else round(100 * (peak / m.lane.model_bytes() - 1), 1),
        chunk_rows=session.chunk,
        dependent_launches=getattr(m.lane, "dependent_launch", None),
    )


def _prefill(lane: Any) -> str:
    """The cuda lane's `prefill` knob as it runs (`auto` resolved when it loaded); empty for the cpu lane."""
    knobs = getattr(lane.shim, "knobs", None)
    weights = getattr(knobs, "prefill_weights", None)
    return weights.value if weights is not None else ""


def _reset_peak(lane: str) -> int:
    """Start counting the GPU memory peak afresh and return what is allocated now, which is not this model's:
    an earlier bench's model is collected first (its lane's graphs and launches hold it in reference cycles,
    which only the collector frees: without it a second depth's peak counted both models)."""
    if lane == "cpu":
        return 0
    try:
        import torch
    except ImportError:
        return 0
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_bytes(lane: Any, before: int = 0) -> int | None:
    """The most GPU memory allocated since `_reset_peak` (`torch.cuda.max_memory_allocated`) less what was
    allocated `before` the load: the weights as the file holds them, the KV cache, the activations and their
    int8 forms, the kernels' scratch."""
    if getattr(lane, "name", "") != "cuda" or not lane.torch.cuda.is_available():
        return None
    return lane.torch.cuda.max_memory_allocated() - before


def _cpu_weights(m: Any) -> list[np.ndarray]:
    """The cpu lane's dequantized weights a decode step reads: every one but an untied embedding table, of
    which a step gathers one row."""
    from fuselane.graph.ir import Role

    lane = m.lane
    return [
        lane.weight(name)
        for name, tensor in lane.graph(1).tensors.items()
        if tensor.role is Role.WEIGHT and not (name == "token_embd.weight" and not m.cfg.tied)
    ]


@contextmanager
def _progress(title: str) -> Iterator[Any]:
    """A rich progress bar on stderr (only on a terminal) for one bench; yields `step(what, total=, advance=)`,
    which names the current phase, sets the number of steps and advances that many."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns, TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        task = bar.add_task(title, total=None)

        def step(what: str | None = None, *, total: int | None = None, advance: int = 0) -> None:
            description = f"{title}: {what}" if what is not None else None
            bar.update(task, description=description, total=total, advance=advance)

        yield step


def render(results: list[BenchResult]) -> str:
    """A llama-bench-like table."""
    head = "| model | size | lane | test | t/s | launches/token | % of limit | peak GPU memory |"
    lines = [head, "|" + "---|" * 8]
    for r in results:
        at = f" @ d{r.depth}" if r.depth else ""
        peak = f"{r.peak_gpu_gb} GB" if r.peak_gpu_gb is not None else ""
        peak += f" (+{r.peak_over_pct} %)" if peak and r.peak_over_pct is not None else ""
        peak += f" ({r.prefill})" if peak and r.prefill else ""
        # the prompt's chunk rows, where it took more than one (llama-bench's ubatch)
        ub = f" (ub {r.chunk_rows})" if 0 < r.chunk_rows < r.prompt else ""
        lines.append(
            f"| {r.model} | {r.size_gb} GB | {r.lane} | pp{r.prompt}{at}{ub} | {r.prefill_tok_s:,.1f} | | | {peak} |"
        )
        lines.append(
            f"| {r.model} | {r.size_gb} GB | {r.lane} | tg{r.generated}{at} | {r.decode_tok_s:,.1f} | "
            f"{_launches(r)} | {r.percent_of_limit} % | {peak} |"
        )
    caches = dict.fromkeys(f"{r.model}: cache {r.cache_values}" for r in results if r.cache_values)
    return "\n".join([*lines, *([""] if caches else []), *caches])


def _launches(r: BenchResult) -> str:
    """A decode step's launches, marked where the cuda lane made them in plain stream order (`pdl`)."""
    if r.launches_per_token is None:
        return ""
    return f"{r.launches_per_token}" + (" (pdl off)" if r.dependent_launches is False else "")


def as_json(results: list[BenchResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]

"""`Model.generate_batch`: many prompts run together through the engine, their replies returned in order.

The engine runs in the caller's thread until every sequence has ended. The pool is sized to the batch: each
sequence's prompt and `max_tokens` (at most its context), and never less than one whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuselane.engine.blocks import DEFAULT_BLOCK_SIZE, BlockPool, blocks_for
from fuselane.engine.engine import Engine
from fuselane.engine.lanes import paged_type
from fuselane.engine.sequence import Event, Request
from fuselane.errors import FuselaneError
from fuselane.ranges import MAX_SEQS, TOKENS
from fuselane.runtime.sampling import SamplingParams


def engine_for(
    model: Any,
    *,
    blocks: int,
    max_seqs: int,
    max_queue: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    chunk: int = 0,
    overlap: bool = True,
) -> Engine:
    """An engine over `model`'s lane in its paged form, with a pool of `blocks` blocks (prefill chunks of `chunk`
    rows a step; 0: the sessions' chunk); `overlap`: decode steps overlap the host's work where the lane can
    (`fuselane.engine.engine`), which changes no token."""
    paged = paged_type(model.lane.name)(model.lane, blocks, block_size, overlap=overlap)
    pool = BlockPool(blocks, block_size)
    sizes = {"chunk": chunk} if chunk else {}
    return Engine(paged, model.tokenizer, pool, ctx=model.ctx, max_seqs=max_seqs, max_queue=max_queue, **sizes)


def generate_batch(
    model: Any,
    prompts: Sequence[str],
    *,
    max_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams],
    raw: bool,
    stop: Sequence[str],
    max_seqs: int | None,
    ignore_eos: bool = False,
) -> list[str]:
    """The reply to each prompt (see `Model.generate_batch`)."""
    TOKENS.check(max_tokens)
    if max_seqs is not None:
        MAX_SEQS.check(max_seqs)
    samplings = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(samplings) != len(prompts):
        raise FuselaneError(f"{len(samplings)} sampling settings for {len(prompts)} prompts")
    if not prompts:
        return []
    ids = [model.prompt_ids(p, raw=raw) for p in prompts]
    seqs = max_seqs or len(prompts)
    need = [blocks_for(min(model.ctx, len(i) + max_tokens), DEFAULT_BLOCK_SIZE) for i in ids]
    blocks = max(sum(sorted(need)[-seqs:]), blocks_for(model.ctx, DEFAULT_BLOCK_SIZE))
    engine = engine_for(model, blocks=blocks, max_seqs=seqs, max_queue=len(prompts))
    texts: dict[int, list[str]] = {}
    errors: list[str] = []

    def sink(event: Event) -> None:
        texts.setdefault(event.seq, []).append(event.text)
        if event.error:
            errors.append(event.error)

    order = [
        engine.submit(Request(tuple(i), max_tokens, s, tuple(stop), ignore_eos), sink)
        for i, s in zip(ids, samplings, strict=True)
    ]
    engine.run_until_idle()
    if errors:
        raise FuselaneError(errors[0])
    return ["".join(texts.get(seq, [])) for seq in order]

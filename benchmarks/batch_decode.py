"""Aggregate decode tokens/s of several sequences at once through the engine (the paged batch form), as
`llama-batched-bench -npp P -ntg N -npl B` measures it: B sequences of P prompt tokens each generate N tokens;
the figure is the tokens generated while all B decode together (from the step after the last one has its first
token to the step where the first one ends), over the time those steps took: the decode steps' throughput at B
rows. (Prompts are prefilled a chunk budget a step while the first ones already decode, so the sequences start
and end staggered; the window where all B run is N minus the prefill's steps, so N should be well past them.)

Usage: python benchmarks/batch_decode.py MODEL [--lane cuda] [--seqs 1 8 32 64] [--prompt 128] [--gen 256]
[--json] [--no-overlap]

`--no-overlap` runs each decode step only after the host has read the last one's tokens (the engine's
`overlap` off), for an A/B against the overlapped decode (the default where the lane has it: the cuda lane).

Prompts are random token ids; greedy sampling. Every sequence generates exactly N tokens, as llama-batched-bench's
do: an end token does not end it (`Request.ignore_eos`; random weights can pick one), so each step runs B rows.

One engine serves every level (its pool sized for the largest). It first makes ready every batch size up to the
largest level and every prefill chunk size (`Engine.warm`, as `fuselane serve` does; on a fresh host the kernels
compile at the model's widths, which takes minutes at a 7B's: the time is printed on stderr), and each level runs
once untimed first; a batch size met for the first time inside the timed run is reported as
`buckets_built_while_timed`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from fuselane.engine.batch import engine_for
from fuselane.engine.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from fuselane.engine.sequence import Request
from fuselane.runtime.model import load


def measure(engine, vocab: int, seqs: int, prompt: int, gen: int, seed: int) -> dict:
    """One level: the decode throughput of `seqs` sequences (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    first: set[int] = set()
    counted = [0]
    timing = [False]
    ended = [False]

    def sink(event) -> None:
        if event.tokens:
            first.add(event.seq)
            if timing[0]:
                counted[0] += len(event.tokens)
        ended[0] |= event.finish is not None

    for _ in range(seqs):
        ids = tuple(int(t) for t in rng.integers(1, vocab - 1, prompt))
        engine.submit(Request(ids, gen, ignore_eos=True), sink)
    while len(first) < seqs and engine.step():
        pass
    steps_before = engine.stats.steps
    buckets_before = _buckets(engine)
    timing[0] = True
    start = time.perf_counter()
    while not ended[0] and engine.step():
        pass
    seconds = time.perf_counter() - start
    timing[0] = False
    steps = engine.stats.steps - steps_before
    while engine.step():  # the rest, untimed
        pass
    return {
        "seqs": seqs,
        "prompt": prompt,
        "gen": gen,
        "decode_tokens": counted[0],
        "decode_steps": steps,
        "seconds": round(seconds, 4),
        "aggregate_tok_s": round(counted[0] / seconds, 1) if seconds else None,
        "blocks_in_use_after": engine.pool.used,
        "buckets_built_while_timed": sorted(_buckets(engine) - buckets_before),
        "overlap": engine.overlap,
    }


def _buckets(engine) -> set[int]:
    """The batch sizes whose steps the engine's lane has built (a lane without buckets: none)."""
    return set(getattr(engine.lane, "steps", {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lane", default="cuda")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="read each step's tokens before the next launches")
    args = ap.parse_args()
    model = load(args.model, lane=args.lane)
    most = max(args.seqs)
    per_seq = blocks_for(args.prompt + args.gen + 1, DEFAULT_BLOCK_SIZE)
    engine = engine_for(model, blocks=per_seq * most, max_seqs=most, max_queue=most, overlap=not args.no_overlap)
    began = time.perf_counter()
    ready = engine.warm()  # what `fuselane serve` does before it listens: minutes of compiles on a fresh host
    print(f"{ready} steps made ready in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    print(f"overlap: {'on' if engine.overlap else 'off'}", file=sys.stderr, flush=True)
    vocab = model.cfg.vocab
    for seqs in args.seqs:
        # untimed first: builds, compiles and captures the steps of the level's batch sizes
        measure(engine, vocab, seqs, args.prompt, args.gen, seed=99)
        r = measure(engine, vocab, seqs, args.prompt, args.gen, seed=seqs)
        line = (
            json.dumps(r)
            if args.json
            else (
                f"{r['seqs']:>3} seqs: {r['aggregate_tok_s']:>10} tok/s ({r['decode_tokens']} tokens in "
                f"{r['decode_steps']} steps, {r['seconds']} s; blocks in use after: {r['blocks_in_use_after']})"
            )
        )
        print(line, flush=True)  # each level as it is measured


if __name__ == "__main__":
    main()

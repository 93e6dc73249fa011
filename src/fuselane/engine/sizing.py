"""How many blocks the KV pool gets: `--kv-blocks` as given, or a fraction of the accelerator's memory
(`--gpu-memory`, as vLLM's `gpu_memory_utilization`: the share of the whole memory the process may hold, weights
included, the rest of that share going to the pool).

Without either, a GPU lane takes `DEFAULT_GPU_MEMORY`, and the cpu lane enough blocks for every sequence to
reach the context's end. The pool never gets more than that (no sequence could use them) and never less than one
whole context (a sequence running alone must always be able to reach the end of its context).
"""

from __future__ import annotations

from fuselane.engine.blocks import blocks_for
from fuselane.engine.lane import DeviceMemory
from fuselane.errors import FuselaneError

DEFAULT_GPU_MEMORY = 0.9  # vLLM's default share: room for the activations and the graphs beside the pool


def pool_blocks(
    *,
    kv_blocks: int | None,
    gpu_memory: float | None,
    ctx: int,
    max_seqs: int,
    block_size: int,
    block_bytes: int,
    device: DeviceMemory | None,
    lane: str,
) -> int:
    """The pool's size in blocks, or a one-line error saying what to change."""
    if kv_blocks is not None and gpu_memory is not None:
        raise FuselaneError("give --kv-blocks or --gpu-memory, not both")
    full = blocks_for(ctx, block_size)
    if kv_blocks is not None:
        blocks = kv_blocks
    elif device is not None:
        share = DEFAULT_GPU_MEMORY if gpu_memory is None else gpu_memory
        blocks = max(0, int(share * device.total) - device.used) // block_bytes
    elif gpu_memory is not None:
        raise FuselaneError(f"--gpu-memory sizes the pool from a GPU's memory; size the {lane} lane's with --kv-blocks")
    else:
        blocks = max_seqs * full
    if blocks < full:
        raise FuselaneError(
            f"a KV pool of {blocks:,} blocks of {block_size} tokens holds less than one context of {ctx:,} tokens "
            f"({full:,} blocks): raise --kv-blocks or --gpu-memory, or lower --ctx"
        )
    return min(blocks, max_seqs * full)

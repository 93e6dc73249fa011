"""The paged KV cache's bookkeeping: one pool of fixed-size blocks, and a block table per sequence.

Memory follows the tokens a sequence actually holds: a sequence takes blocks as its rows reach them and gives
every one back the moment it finishes or is dropped. The pool only counts and hands out block ids; the storage
behind them belongs to the lane (host arrays on the cpu lane, device memory on a GPU lane), which finds a
sequence's row r at block `table.blocks[r // block_size]`, slot `r % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fuselane.errors import FuselaneError

DEFAULT_BLOCK_SIZE = 16  # rows a block holds: a sequence wastes less than one block; vLLM's default too


def blocks_for(rows: int, block_size: int) -> int:
    """Blocks that hold `rows` rows."""
    return -(-rows // block_size)


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks, in the order of its rows."""

    blocks: list[int] = field(default_factory=list)

    def rows(self, start: int, stop: int, block_size: int) -> np.ndarray:
        """The pool rows that hold the sequence's rows start .. stop - 1."""
        logical = np.arange(start, stop)
        return np.asarray(self.blocks, dtype=np.int64)[logical // block_size] * block_size + logical % block_size


class BlockPool:
    """Hands out block ids from a fixed pool; a block belongs to at most one table at a time."""

    def __init__(self, blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if blocks < 1 or block_size < 1:
            raise FuselaneError(f"a KV pool needs at least one block of at least one row, not {blocks} x {block_size}")
        self.total, self.block_size = blocks, block_size
        self._free = list(range(blocks - 1, -1, -1))  # popped from the end: low ids first, which reads well in tests

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def needed(self, table: BlockTable, rows: int) -> int:
        """Blocks `table` lacks to hold `rows` rows."""
        return max(0, blocks_for(rows, self.block_size) - len(table.blocks))

    def grow(self, table: BlockTable, rows: int) -> bool:
        """Give `table` the blocks it lacks for `rows` rows; False, taking nothing, when the pool has too few."""
        lack = self.needed(table, rows)
        if lack > len(self._free):
            return False
        table.blocks.extend(self._free.pop() for _ in range(lack))
        return True

    def release(self, table: BlockTable) -> None:
        """Return every block of `table` to the pool (the table is left empty, so a second release is harmless)."""
        self._free.extend(reversed(table.blocks))
        table.blocks.clear()

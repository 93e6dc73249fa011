"""The allowed range of every number a user gives fuselane, checked where it enters.

Each numeric option of the command line has one `Bound`: its kind (whole number or finite real), its ends and
what it means. The CLI uses a bound as argparse's `type=` (so a bad value is refused while the arguments are
parsed, before any model is opened) and the Python API checks the same bound, so both say the same one line,
which names the allowed range. NaN and the infinities are never in range: a temperature of inf samples
uniformly, a context of 2**62 rows is an allocation no machine has.
"""

from __future__ import annotations

import argparse
import enum
import math
import numbers
from dataclasses import dataclass

from fuselane.errors import FuselaneError

SHOWN_CHARS = 40  # a refused value is quoted up to this length: a 100,000-digit number stays one short line
# The longest context fuselane will make room for: past every released checkpoint's, and a bound that keeps
# size arithmetic (prompt + depth + generated, cache bytes) far from any overflow. The model's own context is
# checked once its file is open.
MAX_CTX = 1 << 20
MAX_TOP_K = (1 << 31) - 1  # llama.cpp's int32; any k at or past the vocabulary switches the filter off
MAX_BENCH_REPETITIONS = 1000  # a bench past this many timed prompts measures nothing more
# timed runs of a bench's prompt, their tokens/s averaged (llama-bench's `-r` and its default): one run of a chunk
# that takes tens of milliseconds is at the mercy of whatever the host and the device did just before
DEFAULT_BENCH_REPETITIONS = 5
# numpy's SeedSequence keeps 128 bits of entropy; a larger seed adds nothing a user could rely on
MAX_SEED = (1 << 128) - 1
MAX_TP = 1 << 10  # ranks of one split: far past any host's GPUs, low enough that a typo is refused at once


class Kind(enum.Enum):
    """Whole numbers, or finite reals."""

    INT = "an integer"
    REAL = "a number"


@dataclass(frozen=True, slots=True)
class Bound:
    """An option's allowed values: `low` to `high` (None: no upper end but finiteness), `low` excluded when
    `open_low`; `flag` and `what` name it in the message."""

    flag: str
    what: str
    kind: Kind
    low: float
    high: float | None = None
    open_low: bool = False

    def describe(self) -> str:
        """The range in words: "an integer in [1, 1048576]", "a finite number >= 0", "a number in (0, 1]"."""
        if self.high is None:
            finite = "finite " if self.kind is Kind.REAL else ""
            article, noun = self.kind.value.split(" ", 1)
            return f"{'a' if finite else article} {finite}{noun} {'>' if self.open_low else '>='} {_num(self.low)}"
        left = "(" if self.open_low else "["
        return f"{self.kind.value} in {left}{_num(self.low)}, {_num(self.high)}]"

    def message(self, shown: str, *, flag: bool = True) -> str:
        """The refusal; without `flag` for argparse, which puts "argument --ctx:" before it."""
        return f"{f'{self.flag} ({self.what})' if flag else self.what} must be {self.describe()}, not {shown}"

    def contains(self, value: float) -> bool:
        if self.kind is Kind.REAL and not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        return above and (self.high is None or value <= self.high)

    def check(self, value: float) -> None:
        """Raise the one-line FuselaneError unless `value` is in range (for the Python API)."""
        number = numbers.Integral if self.kind is Kind.INT else numbers.Real
        if isinstance(value, bool) or not isinstance(value, number) or not self.contains(value):
            raise FuselaneError(self.message(_shown(str(value))))

    def __call__(self, text: str) -> int | float:
        """Parse and check a command-line value (argparse's `type=`)."""
        try:
            value = int(text, 10) if self.kind is Kind.INT else float(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(self.message(_shown(text), flag=False)) from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(self.message(_shown(text), flag=False))
        return value


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 1 << 53 and (x + 1).bit_count() == 1:
        return f"2^{x.bit_length()} - 1"  # the seed's end reads better than 39 digits
    return str(int(x)) if float(x).is_integer() else repr(x)


def _shown(text: str) -> str:
    """A value as a message quotes it: one line, at most SHOWN_CHARS characters."""
    quoted = repr(text)[1:-1]  # escapes newlines and other control characters
    return quoted if len(quoted) <= SHOWN_CHARS else quoted[: SHOWN_CHARS - 3] + "..."


# --- the bounds of the options ------------------------------------------------------------------------------

TOKENS = Bound("-n", "tokens to generate", Kind.INT, 0, MAX_CTX)
CTX = Bound("--ctx", "context size in tokens", Kind.INT, 1, MAX_CTX)
TEMPERATURE = Bound("--temp", "temperature", Kind.REAL, 0)
TOP_K = Bound("--top-k", "tokens top-k keeps", Kind.INT, 0, MAX_TOP_K)
TOP_P = Bound("--top-p", "top-p's nucleus mass", Kind.REAL, 0, 1, open_low=True)
SEED = Bound("--seed", "random seed", Kind.INT, 0, MAX_SEED)
BENCH_PROMPT = Bound("-p", "prompt tokens", Kind.INT, 1, MAX_CTX)
BENCH_GENERATED = Bound("-n", "generated tokens", Kind.INT, 1, MAX_CTX)
BENCH_DEPTH = Bound("--depth", "tokens already in the cache", Kind.INT, 0, MAX_CTX)
BENCH_REPETITIONS = Bound("-r", "timed runs of the prompt", Kind.INT, 1, MAX_BENCH_REPETITIONS)
PORT = Bound("--port", "TCP port (0: any free one)", Kind.INT, 0, 65535)
MAX_SEQS = Bound("--max-seqs", "sequences run together", Kind.INT, 1, 1 << 16)
MAX_QUEUE = Bound("--max-queue", "requests that may wait for a place", Kind.INT, 0, 1 << 20)
KV_BLOCKS = Bound("--kv-blocks", "blocks of the KV pool", Kind.INT, 1, 1 << 30)
GPU_MEMORY = Bound("--gpu-memory", "share of the GPU's memory the server may hold", Kind.REAL, 0, 1, open_low=True)
TP = Bound("--tp", "GPUs to split the model over", Kind.INT, 1, MAX_TP)
ROWS = Bound("--rows", "rows of a prefill chunk or sequences of a batch (at least one row)", Kind.INT, 1, MAX_CTX)

__all__ = ["Bound", "Kind", "MAX_CTX", "MAX_SEED", "MAX_TOP_K"]

"""A lane's numerics contract: what it keeps in which precision, what it quantizes and how, and how far a
fusion may move a result.

Tests derive their tolerances from a lane's contract instead of hard-coding one: a fused op computes the same
numbers as its parts (`fused` is exact), and a lane that quantizes activations or keeps its cache in f16 is
held to the error those choices imply, against the cpu lane in f64.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from fuselane.graph.ir import Fused, Op, QuantFormat, TensorGraph
from fuselane.graph.ops import Matmul

QBLOCK = 32  # values under one scale in a quantized activation
INT8_MAX = 127


class Keep(enum.Enum):
    """A precision something is kept in."""

    F64 = "f64"
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"

    @property
    def unit_roundoff(self) -> float:
        """Half the gap between 1 and the next representable number."""
        return {Keep.F64: 2.0**-53, Keep.F32: 2.0**-24, Keep.F16: 2.0**-11, Keep.BF16: 2.0**-8}[self]


class Block(enum.Enum):
    """What one scale covers."""

    QBLOCK = "32 values"
    ROW = "a row"


class Scale(enum.Enum):
    """How a scale is chosen."""

    MAX_OVER_127 = "largest |value| / 127"


@dataclass(frozen=True, slots=True)
class Scheme:
    """A quantization: int8 words under a scale per block; `words` int8 words a value (each further word
    holds the rounding error of the ones before, at 1/127 of their scale)."""

    block: Block
    scale: Scale
    words: int

    @staticmethod
    def of(fmt: QuantFormat) -> Scheme:
        """The scheme of an activation format."""
        words = {QuantFormat.ONE_WORD: 1, QuantFormat.TWO_WORDS: 2}[fmt]
        return Scheme(Block.QBLOCK, Scale.MAX_OVER_127, words)

    @property
    def relative_step(self) -> float:
        """The largest rounding error of a value, relative to its block's largest |value|."""
        return 0.5 / INT8_MAX**self.words

    def describe(self) -> str:
        return f"int8 x{self.words} a value, one scale ({self.scale.value}) per {self.block.value}"


@dataclass(frozen=True, slots=True)
class Kept:
    """An operand taken as it is kept, in a precision."""

    keep: Keep


@dataclass(frozen=True, slots=True)
class Quantized:
    """An operand quantized under a scheme."""

    scheme: Scheme


Taken = Kept | Quantized


@dataclass(frozen=True, slots=True)
class AttentionNumerics:
    """How a wide chunk's attention takes its operands (and, where the lane says so, a decode step's)."""

    queries: Taken
    keys_values: Taken
    weights: Taken


@dataclass(frozen=True, slots=True)
class Bound:
    """How far a fusion may move a result, relative to the largest magnitude compared; 0 is exact."""

    relative: float

    @property
    def exact(self) -> bool:
        return self.relative == 0.0


Bound.EXACT = Bound(0.0)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Contract:
    """A lane's numerics at a point (its knobs): activations (None: products read dequantized values), cache,
    recurrent state, wide attention, the fused bound, and the accumulator width of its products."""

    point: str
    activations: Scheme | None
    cache: Keep
    state: Keep
    attention: AttentionNumerics | None
    fused: Bound
    accumulator_bits: int
    arithmetic: Keep = Keep.F32

    def logits_tolerance(self, depth: int) -> float:
        """A bound on the relative error of logits against an f64 reference after `depth` layers.

        Each layer's error compounds from the arithmetic's roundoff, the cache's, and the activations'
        quantization step, and a recurrent state's rounding (summed into every step, as the cache's); the constant
        8 covers the products, norm and attention of a layer. This is a model of the error, not a proof; it is
        what the GPU tests hold a lane to.
        """
        per_layer = self.arithmetic.unit_roundoff + self.cache.unit_roundoff + self.state.unit_roundoff
        if self.activations is not None:
            per_layer += self.activations.relative_step
        return 8 * per_layer * math.sqrt(depth)


def holds_accumulator(op: Op, g: TensorGraph, bits: int, scheme: Scheme | None = None) -> str | None:
    """Why an op's integer products would overflow a `bits`-bit accumulator, or None when they fit.

    Under quantized activations a product sums k products of int8 words; the largest sum must stay below
    2^(bits - 1).
    """
    if scheme is None:
        return None
    limit = 2 ** (bits - 1)
    for leaf in _leaves(op):
        spec = leaf.sym
        if isinstance(spec, Matmul) and spec.k * INT8_MAX * INT8_MAX >= limit:
            return f"a product of {spec.k} int8 terms overflows the lane's {bits}-bit accumulator"
    return None


def _leaves(op: Op) -> list[Op]:
    if isinstance(op.sym, Fused):
        return [leaf for part in op.sym.parts for leaf in _leaves(part)]
    return [op]

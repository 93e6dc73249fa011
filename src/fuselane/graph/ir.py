"""The tensor graph: named tensors with storage and shape, and ops in schedule order.

An op reads its inputs (each with an access: whole, or a strided part of every unit read in place) and writes
its output to a destination: a buffer of its own, a row of a table (a KV-cache row at a position parameter),
or a part of every unit of a wider tensor. Its symbol is a primitive spec or a fused class with its parts;
`covers` lists the original ops it stands for, so a fused schedule can be checked to cover each once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId
from fuselane.graph.ops import PrimSpec


class Role(enum.Enum):
    """Why a tensor exists: it changes how a lane allocates it and how long it lives."""

    WEIGHT = "weight"  # from the checkpoint
    INPUT = "input"  # token ids fed to a step
    PARAM = "param"  # a scalar bound per call (the position)
    CACHE = "cache"  # persists across steps (KV cache)
    STATE = "state"  # persists across steps, summing the whole sequence (a recurrent layer's state)
    ACTIVATION = "activation"  # lives within one step
    OUTPUT = "output"  # what the step returns (logits)


@dataclass(frozen=True, slots=True)
class Values:
    """Plain values of one element type (`f32`, `f16`, `bf16`, `i32`)."""

    dtype: str


@dataclass(frozen=True, slots=True)
class Rows:
    """Checkpoint rows in a quantized format; `transposed` when the rows are a product's inputs, not outputs."""

    format: Format
    transposed: bool = False


class QuantFormat(enum.Enum):
    """The quantized form in which a product reads its activation: int8 codes under a scale a 32-value block,
    one word a value, or two (a second int8 word holding the first's rounding error)."""

    ONE_WORD = "int8"
    TWO_WORDS = "int8x2"


@dataclass(frozen=True, slots=True)
class QuantizedActs:
    """An activation its producer writes already quantized for the products that read it."""

    format: QuantFormat


Storage = Values | Rows | QuantizedActs


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    storage: Storage
    role: Role


@dataclass(frozen=True, slots=True)
class Whole:
    """The input is read whole."""

    def __repr__(self) -> str:
        return "whole"


@dataclass(frozen=True, slots=True)
class Strided:
    """`width` values at `offset` of every `pitch`-wide unit of the input, read in place."""

    pitch: int
    offset: int
    width: int


Access = Whole | Strided
WHOLE = Whole()


@dataclass(frozen=True, slots=True)
class RowAt:
    """Rows of a table starting at a position: a parameter's name or a literal row."""

    sel: str | int
    pitch: int


@dataclass(frozen=True, slots=True)
class UnitPart:
    """`width` values at `offset` of every `pitch`-wide unit of the destination."""

    pitch: int
    offset: int
    width: int


@dataclass(frozen=True, slots=True)
class Dst:
    """Where an op writes: `buf` whole, or a row of it, or a part of each of its units."""

    buf: str
    row: RowAt | None = None
    unit: UnitPart | None = None

    def own(self) -> str | None:
        """The buffer's name when the op writes a buffer of its own, whole."""
        return self.buf if self.row is None and self.unit is None else None


@dataclass(frozen=True, slots=True)
class Fused:
    """A fused op: a class and the ops it stands for, in their original order, and the kernel launches it runs
    as (a lane rule that sizes several launches for it says how many)."""

    cls: ClassId
    parts: tuple[Op, ...]
    launches: int = 1


@dataclass(frozen=True, slots=True)
class Op:
    sym: PrimSpec | Fused
    ins: tuple[str, ...]
    access: tuple[Access, ...]
    out: str
    dst: Dst
    covers: tuple[int, ...] = ()

    def prim(self) -> PrimSpec | None:
        """The primitive spec, or None for a fused op."""
        return None if isinstance(self.sym, Fused) else self.sym


class Form(enum.Enum):
    """The shape of work a graph is built for."""

    DECODE = "decode"  # one row of one sequence
    PREFILL = "prefill"  # a chunk of rows of one sequence
    BATCH = "batch"  # one row of each of several sequences, each at its own position


@dataclass(slots=True)
class TensorGraph:
    """Tensors by name and ops in schedule order, for one form at concrete shapes."""

    form: Form
    rows: int
    tensors: dict[str, Tensor] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    inputs: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def add(self, tensor: Tensor) -> str:
        if tensor.name in self.tensors and self.tensors[tensor.name] != tensor:
            raise ValueError(f"tensor {tensor.name} declared twice with different shapes")
        self.tensors[tensor.name] = tensor
        return tensor.name

    def emit(self, sym: PrimSpec, ins: tuple[str, ...], out: str, dst: Dst | None = None) -> Op:
        """Append a primitive op reading `ins` whole and writing `out` (its own buffer unless `dst`)."""
        op = Op(sym, ins, tuple(WHOLE for _ in ins), out, dst or Dst(out), (len(self.ops),))
        self.ops.append(op)
        return op

"""What the cuda shim's fit checks read of the shim (`fits`, `fits_recurrent`): a protocol, so the check modules
import neither the shim nor each other back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from fuselane.fuse.views import GemvForm
from fuselane.graph.ir import Op, QuantFormat, TensorGraph
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.numerics.contract import Scheme

GEMV_PARTS = "gemv_parts"  # the lane rule's name, which `--hold` takes (`rules.gemv_parts`)


class CudaShim(Protocol):
    """What the checks read of the cuda shim (`shim.CudaShim`, which calls `fits`): its knobs, what it holds,
    its numerics and its answers about products. A protocol, so this module does not import the shim back."""

    knobs: CudaKnobs
    held: tuple[str, ...]

    @property
    def accumulator_bits(self) -> int: ...

    @property
    def scheme(self) -> Scheme | None: ...

    @property
    def activation_format(self) -> QuantFormat | None: ...

    @staticmethod
    def int8_gemv(p: GemvForm) -> bool: ...

    def fits(self, op: Op, g: TensorGraph) -> str | None: ...

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None: ...

    def quantizes_in_epilogue(self, producer: Op, g: TensorGraph) -> bool: ...

    def per_warp(self, p: GemvForm) -> int: ...

    def part_product(self, op: Op, g: TensorGraph) -> GemvForm | None: ...

    def rows_product(self, op: Op, g: TensorGraph) -> GemvForm | None: ...

    def gemv_mergeable(self, p: GemvForm) -> bool: ...

    def gemv_takes(self, p: GemvForm, g: TensorGraph) -> bool: ...

    def gemv_in_parts(self, members: Sequence[Op], g: TensorGraph) -> bool: ...

    def gemm_parts(self, members: Sequence[Op], g: TensorGraph) -> bool: ...

    def pairs_on_cublas(self, g: TensorGraph) -> bool: ...

    def moe_down_launch(self, op: Op, g: TensorGraph) -> tuple[int, int] | None: ...


Check = Callable[[CudaShim, Op, Sequence[Op], TensorGraph], "str | None"]

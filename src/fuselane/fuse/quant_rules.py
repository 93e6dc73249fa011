"""Quantizing epilogues: a producer writes its result's quantized form too where an op reads it quantized (the
lane's `activation`) and every op that reads it quantized reads the same form, so no launch quantizes it apart.
Its f32 result stays for the ops that read it so (a mixture's router reads the norm its experts read in int8).

They fire only where the lane's products read quantized activations; whether the lane's kernels quantize in
their epilogue at all (`fuse_quant`) is the lane's `supports` answer for each class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fuselane.fuse.patterns import op_at
from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rule import Rule
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op, QuantFormat, QuantizedActs
from fuselane.graph.ops import Attention, Elementwise, HeadMatmul, Matmul, SetRow


def wanted_format(r: Rewriter, op: Op) -> QuantFormat | None:
    """The one quantized form in which the readers of op's result that read it quantized read it, or None (none
    reads it quantized, or they read it in two forms). Readers of its f32 form do not count: a quantizing
    producer writes both."""
    readers = r.s.readers(op.out)
    if not readers or op.out in r.outputs:
        return None
    formats = set()
    for j in readers:
        reader = r.s.get(j)
        for k, name in enumerate(reader.ins):
            if name == op.out:
                formats.add(r.shim.activation(reader, k, r.g))
    formats.discard(None)
    (fmt,) = formats if len(formats) == 1 else (None,)
    return fmt


def _quantizing(name: str, builds: C, *producers: type | C) -> Callable[[Rewriter, int], None]:
    def pattern(r: Rewriter, i: int) -> None:
        op = op_at(r, i, *producers)
        if op is None:
            return
        fmt = wanted_format(r, op)
        if fmt is not None and r.try_fuse(name, builds, [i], i):
            tensor = r.g.tensors[op.out]
            r.g.tensors[op.out] = replace(tensor, storage=QuantizedActs(fmt))

    return pattern


def _rule(name: str, builds: C, *producers: type | C) -> Rule:
    return Rule(name, (builds,), _quantizing(name, builds, *producers))


QUANT_RULES = [
    # norm -> int8 rows (a mixture's last step norms too)
    _rule("norm_quant", C.NORM_QUANT, C.NORM_WEIGHT, C.EMBED_NORM, C.GEMV_NORM_EPILOGUE, C.MOE_DEFERRED_FINALIZE),
    _rule("add_norm_quant", C.ADD_NORM_QUANT, C.ADD_NORM),  # AddNorm -> writes its norm as int8
    # silu(g) * u -> int8 (the kept experts' too)
    _rule("glu_quant", C.GLU_ACT_MUL_QUANT, C.GLU_ACT_MUL, C.GEMV_GATE_UP_GLU, C.MOE_GATE_UP_ACT, C.ATTN_OUTPUT_GATE),
    _rule("gdn_output_quant", C.GDN_OUTPUT_QUANT, C.GATED_NORM),  # norm(o) * w * silu(z) -> int8
    _rule("elementwise_quant", C.ELEMENTWISE_QUANT, Elementwise),  # a (op) b -> int8
    _rule("gemv_quant", C.GEMV_QUANT, Matmul, HeadMatmul, C.GEMM_BIAS),  # x @ W^T (or each head's) -> int8 outputs
    # attention(q, k, v) -> writes its output as int8
    _rule("attention_output_quant", C.ATTN_OUTPUT_QUANT, Attention, C.FLASH_DECODE, C.FLASH_PREFILL),
    _rule("row_write_quant", C.ROW_WRITE_QUANT, SetRow),  # set_row -> the row and its int8 form
]
